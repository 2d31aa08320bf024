// tests/jinja/compare.mjs — gw_jinja against @huggingface/jinja, byte for byte (README.md here).
//
// Renders every template of TEMPLATES (*.jinja) with every context of CASES (*.json) twice:
// with the reference, @huggingface/jinja (the JavaScript implementation Hugging Face uses for
// chat templates), and with jinja_render (the C driver over services/gateway/gw_jinja). Each pair
// must give the same bytes, or both must raise (or gw_jinja raise where Python's Jinja does and the
// reference writes a JavaScript artefact, below). Exit 0 when all agree, 1 otherwise, with a diff
// excerpt per mismatch.
//
// Usage: node compare.mjs JINJA_RENDER TEMPLATES CASES JINJA_MODULE_DIR
'use strict';

import fs from 'fs';
import path from 'path';
import { spawnSync } from 'child_process';

const [, , driver, templatesDir, casesDir, moduleDir] = process.argv;
if (!driver || !templatesDir || !casesDir || !moduleDir) {
  console.error('usage: node compare.mjs JINJA_RENDER TEMPLATES CASES JINJA_MODULE_DIR');
  process.exit(2);
}
const { Template } = await import(path.resolve(moduleDir, 'dist/index.js'));

// Where the reference concatenates a string with a list or dict it writes a JavaScript artefact
// ("[object Map]", "[object Object]"); Python's Jinja raises TypeError there, and so must gw_jinja.
const jsArtefact = /\[object (Map|Object)\]/;
// With a list it writes the elements' JSON joined by ","; these pairs do that (content given as a
// list of parts to templates that expect a string), and gw_jinja must raise there too.
const stringPlusList = {
  'content_parts.json': ['chatml.jinja', 'deepseek_r1.jinja', 'phi3.jinja', 'qwen2.jinja', 'qwen2.5.jinja', 'qwen3.jinja'],
};

function reference(src, ctx) {
  try {
    return { out: new Template(src).render(ctx) };
  } catch (e) {
    return { err: String(e && e.message ? e.message : e) };
  }
}

function ours(templatePath, casePath) {
  const r = spawnSync(driver, [templatePath, casePath], { maxBuffer: 64 << 20 });
  if (r.error) throw r.error;
  if (r.status === 0) return { out: r.stdout.toString('utf8') };
  if (r.status === 2) return { err: r.stderr.toString('utf8').trim() };
  throw new Error(`${driver} ${templatePath} ${casePath}: exit ${r.status}: ${r.stderr}`);
}

function excerpt(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  const from = Math.max(0, i - 60);
  return `  first difference at character ${i}\n` +
    `  reference: ${JSON.stringify(a.slice(from, i + 60))}\n` +
    `  gw_jinja:  ${JSON.stringify(b.slice(from, i + 60))}`;
}

const list = (dir, ext) => fs.readdirSync(dir).filter((f) => f.endsWith(ext)).sort();
let equal = 0, bothRaised = 0, pythonRaised = 0, failures = 0;
for (const t of list(templatesDir, '.jinja')) {
  const tPath = path.join(templatesDir, t);
  const src = fs.readFileSync(tPath, 'utf8');
  for (const c of list(casesDir, '.json')) {
    const cPath = path.join(casesDir, c);
    const ref = reference(src, JSON.parse(fs.readFileSync(cPath, 'utf8')));
    const got = ours(tPath, cPath);
    const key = `${t} ${c}`;
    const pythonRaises = (stringPlusList[c] || []).includes(t);
    if (ref.out !== undefined && (pythonRaises || jsArtefact.test(ref.out))) {
      if (got.err !== undefined) {
        pythonRaised++;
        if (process.env.JINJA_VERBOSE) console.log(`raised as Python does ${key}\n  gw_jinja:  ${got.err}`);
        continue;
      }
      console.log(`MISMATCH ${key}: the reference concatenated a string with a list or dict; ` +
        'gw_jinja must raise as Python does (TypeError), it rendered');
      failures++;
    } else if (ref.err !== undefined && got.err !== undefined) {
      bothRaised++;
      if (process.env.JINJA_VERBOSE) console.log(`both raised ${key}\n  reference: ${ref.err}\n  gw_jinja:  ${got.err}`);
    } else if (ref.err !== undefined || got.err !== undefined) {
      console.log(`MISMATCH ${key}: ` + (ref.err !== undefined
        ? `the reference raised (${ref.err}), gw_jinja rendered ${got.out.length} characters`
        : `gw_jinja raised (${got.err}), the reference rendered ${ref.out.length} characters`));
      failures++;
    } else if (ref.out === got.out) {
      equal++;
    } else {
      console.log(`MISMATCH ${key}: outputs differ\n${excerpt(ref.out, got.out)}`);
      failures++;
    }
  }
}
console.log(`jinja: ${equal} renders equal, ${bothRaised} both raised, ${pythonRaised} raised as Python does ` +
  '(string + list/dict)' +
  (failures ? `, ${failures} MISMATCHED` : ''));
process.exit(failures ? 1 : 0);
