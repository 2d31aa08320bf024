#!/usr/bin/env node
// tests/deploy/render-tools.js — small helpers over a rendered chart (helm template output).
//
//   node render-tools.js --deps DIR configs RENDER.yaml OUTDIR
//       writes each service's config file from the ConfigMaps (OUTDIR/<svc>.yaml, for
//       <svc>.yaml data keys) and the names of the PIE_* variables its pods set
//       (OUTDIR/<svc>.env, one per line; the component label names the service).
'use strict';

const fs = require('fs');
const path = require('path');
const Module = require('module');

const argv = process.argv.slice(2);
if (argv[0] !== '--deps' || argv.length < 3) {
  console.error('usage: render-tools.js --deps DIR configs RENDER.yaml OUTDIR');
  process.exit(2);
}
const req = Module.createRequire(path.join(path.resolve(argv[1]), 'noop.js'));
const yaml = req('js-yaml');
const [cmd, render, outdir] = argv.slice(2);
if (cmd !== 'configs') {
  console.error(`render-tools: unknown command ${cmd}`);
  process.exit(2);
}
const docs = yaml.loadAll(fs.readFileSync(render, 'utf8')).filter((d) => d && typeof d === 'object');
const envs = {};
const templates = (d) => {
  const s = d.spec || {};
  if (d.kind === 'Deployment' || d.kind === 'StatefulSet') return [s.template];
  if (d.kind === 'LeaderWorkerSet') {
    return [s.leaderWorkerTemplate.leaderTemplate, s.leaderWorkerTemplate.workerTemplate].filter(Boolean);
  }
  return [];
};
let configs = 0;
for (const d of docs) {
  if (d.kind === 'ConfigMap') {
    for (const [key, text] of Object.entries(d.data || {})) {
      const m = /^(controller|worker|lifecycle|gateway)\.yaml$/.exec(key);
      if (m) {
        fs.writeFileSync(path.join(outdir, key), text);
        configs++;
      }
    }
  }
  for (const t of templates(d)) {
    const svc = t.metadata.labels['app.kubernetes.io/component'];
    envs[svc] = envs[svc] || new Set();
    for (const c of t.spec.containers || []) {
      for (const e of c.env || []) if (e.name.startsWith('PIE_')) envs[svc].add(e.name);
    }
  }
}
for (const [svc, names] of Object.entries(envs)) {
  fs.writeFileSync(path.join(outdir, `${svc}.env`), [...names].sort().join('\n') + (names.size ? '\n' : ''));
}
console.log(`render-tools: ${configs} config file(s), env of ${Object.keys(envs).join(', ')}`);
