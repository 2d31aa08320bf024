// tests/tok/tiktoken_ref.js — the reference side of the tokenizer check (tests/tok/README.md).
//
// From OpenAI's tiktoken (the npm package `tiktoken`: tiktoken's Rust core compiled to WASM,
// with the rank tables of its encodings) this writes, for one encoding:
//   OUT/tokenizer.json  the encoding as a Hugging Face byte-level BPE tokenizer.json, the form
//                       pie_tok loads (vocab = ranks, merges derived from the ranks, the
//                       encoding's regex, its special tokens as added_tokens);
//   OUT/cases.txt       texts and the ids tiktoken gives them: a fixed corpus plus seeded
//                       random strings; one line per text: LABEL ALLOW HEX IDS...
//                       (ALLOW 1: special tokens allowed, `encode(text, "all")`; 0:
//                       `encode_ordinary`; HEX: the text's UTF-8 bytes);
//   OUT/excluded.txt    the code points random strings avoid (below).
//
// Usage: node tiktoken_ref.js ENCODING OUT CLASSES [N_RANDOM] [SEED]
//   ENCODING  gpt2, cl100k_base or o200k_base
//   CLASSES   PCRE2's view of every code point, as `tok_ref_check classes` writes it
//
// Random strings avoid exactly the code points whose regex classes (letter, number, mark, the
// letter subcategories o200k uses) differ between PCRE2's Unicode tables and Node's (a newer
// Unicode: letters added since PCRE2's version are "not a letter" to PCRE2). That difference is
// documented in services/common/tok/README.md; everything else must agree. (White space is not
// compared: pie_tok spells \s out as Unicode's White_Space, independent of the tables.)
'use strict';

const fs = require('fs');
const path = require('path');

const [, , encName, outDir, classesPath, nRandomArg, seedArg] = process.argv;
if (!encName || !outDir || !classesPath) {
  console.error('usage: node tiktoken_ref.js ENCODING OUT CLASSES [N_RANDOM] [SEED]');
  process.exit(2);
}
const nRandom = nRandomArg ? Number(nRandomArg) : 3000;
const seed = seedArg ? Number(seedArg) : 20240517;

const { Tiktoken } = require('tiktoken/lite');
const enc = require(`tiktoken/encoders/${encName}.json`);

// ---- the rank table ---------------------------------------------------------------------------

// tiktoken's compact format: lines of "<ignored> <first rank> <base64 token> <base64 token> ...".
function parseRanks(bpeRanks) {
  const tokens = []; // rank -> Buffer
  for (const line of bpeRanks.split('\n')) {
    if (line === '') continue;
    const [, offsetStr, ...b64] = line.split(' ');
    const offset = Number(offsetStr);
    b64.forEach((t, i) => {
      tokens[offset + i] = Buffer.from(t, 'base64');
    });
  }
  return tokens;
}

// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
// for U+0100.. in byte order.
const byteToChar = (() => {
  const printable = (b) => (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  const map = [];
  let n = 0;
  for (let b = 0; b < 256; b++) map[b] = String.fromCodePoint(printable(b) ? b : 256 + n++);
  return map;
})();
const byteLevel = (buf) => Array.from(buf, (b) => byteToChar[b]).join('');

// Merges such that rank-ordered BPE over them is tiktoken's: tiktoken merges the adjacent pair
// whose concatenation has the lowest rank, so every split of a token into two tokens is a merge,
// ranked by the token (splits of one token in the order of their parts' ranks, as Hugging Face's
// converter of tiktoken files does).
function deriveMerges(tokens, rankOf) {
  const merges = [];
  for (let rank = 0; rank < tokens.length; rank++) {
    const t = tokens[rank];
    if (t === undefined || t.length < 2) continue;
    const local = [];
    for (let k = 1; k < t.length; k++) {
      const l = rankOf.get(t.subarray(0, k).toString('latin1'));
      const r = rankOf.get(t.subarray(k).toString('latin1'));
      if (l !== undefined && r !== undefined) local.push([l, r]);
    }
    local.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    for (const m of local) merges.push(m);
  }
  return merges;
}

function tokenizerJson(tokens, merges) {
  const gpt2 = encName === 'gpt2';
  const vocab = {};
  tokens.forEach((t, rank) => {
    if (t !== undefined) vocab[byteLevel(t)] = rank;
  });
  const added = Object.entries(enc.special_tokens)
    .sort((a, b) => a[1] - b[1])
    .map(([content, id]) => ({
      id, content, single_word: false, lstrip: false, rstrip: false, normalized: false,
      special: true,
    }));
  // GPT-2 as published: ByteLevel's built-in regex and "a b" merges. The others as Llama 3 is
  // published: the encoding's regex in a Split, ["a", "b"] merges, ignore_merges (tiktoken
  // encodes a piece that is itself a token as that token).
  const pre = gpt2
    ? { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true }
    : {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: enc.pat_str }, behavior: 'Isolated', invert: false },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
      ],
    };
  const model = {
    type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: false, byte_fallback: false,
  };
  if (!gpt2) model.ignore_merges = true;
  model.vocab = vocab;
  model.merges = merges.map(([l, r]) => gpt2
    ? `${byteLevel(tokens[l])} ${byteLevel(tokens[r])}`
    : [byteLevel(tokens[l]), byteLevel(tokens[r])]);
  return {
    version: '1.0', truncation: null, padding: null, added_tokens: added, normalizer: null,
    pre_tokenizer: pre, post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model,
  };
}

// ---- which code points random strings avoid ---------------------------------------------------

// Bits as tok_ref_check writes them.
const CLASSES = [
  ['L', /\p{L}/u], ['N', /\p{N}/u], ['M', /\p{M}/u], ['Lu', /\p{Lu}/u], ['Ll', /\p{Ll}/u],
  ['Lt', /\p{Lt}/u], ['Lm', /\p{Lm}/u], ['Lo', /\p{Lo}/u],
];

function jsClasses(cp) {
  const s = String.fromCodePoint(cp);
  let bits = 0;
  CLASSES.forEach(([, re], i) => {
    if (re.test(s)) bits |= 1 << i;
  });
  return bits;
}

// CLASSES file: "# unicode VERSION" then lines "FIRST LAST BITS" (hex code points, decimal bits).
function excludedCodePoints(file) {
  const pcre = new Uint8Array(0x110000);
  let unicode = '?';
  for (const line of fs.readFileSync(file, 'utf8').split('\n')) {
    if (line.startsWith('# unicode ')) unicode = line.slice(10).trim();
    if (line === '' || line.startsWith('#')) continue;
    const [a, b, bits] = line.split(' ');
    pcre.fill(Number(bits), parseInt(a, 16), parseInt(b, 16) + 1);
  }
  const excluded = new Set();
  for (let cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xd800 && cp <= 0xdfff) continue;
    if (jsClasses(cp) !== pcre[cp]) excluded.add(cp);
  }
  return { excluded, unicode };
}

function rangesText(set) {
  const cps = [...set].sort((a, b) => a - b);
  const lines = [];
  for (let i = 0; i < cps.length;) {
    let j = i;
    while (j + 1 < cps.length && cps[j + 1] === cps[j] + 1) j++;
    const hex = (c) => c.toString(16).toUpperCase().padStart(4, '0');
    lines.push(i === j ? hex(cps[i]) : `${hex(cps[i])}..${hex(cps[j])}`);
    i = j + 1;
  }
  return lines;
}

// ---- the fixed corpus -------------------------------------------------------------------------

function fixedCorpus() {
  const specials = Object.keys(enc.special_tokens);
  const sp = specials[0]; // <|endoftext|>
  const texts = [];
  const add = (t, allow = false) => texts.push([t, allow]);

  // code
  add('int main(int argc, char **argv) {\n    printf("%d\\n", argc);\n    return 0;\n}\n');
  add('def f(x):\n\treturn x ** 2  # square\n\n\nclass A(B):\n    pass\n');
  add('for (let i = 0; i < n; i++) { if (a[i] !== b[i]) return false; }');
  add('const re = /^(?:[a-z0-9_.+-]+)@([a-z0-9-]+\\.)+[a-z]{2,}$/i;');
  add('#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.c; do gcc -O2 -c "$f"; done\n');
  add('{"id": 17, "name": "Ada", "tags": ["x", "y"], "ok": true, "v": -1.5e-3}');
  add('<div class="a"><p>Hello &amp; welcome</p></div>\n<!-- note -->');
  add('SELECT id, COUNT(*) FROM t WHERE x >= 10 GROUP BY id HAVING COUNT(*) > 1;');
  add('https://example.com/path/to/file.html?q=1&r=two#frag');
  add('path/to/some/file.txt and ../../up/../down/ and C:\\Windows\\System32');
  add('XMLHttpRequest getHTTPResponseCode iPhone camelCaseWord snake_case_word SCREAMING_CASE');
  add('a/b/c //x\n/\n//\n/// triple');
  add('x+=1;y-=2;z*=3;w/=4;q%=5;a<<=1;b>>=2;c&&d||e!f');
  add('    indented\n        more\n\t\ttabs\n  \t mixed\n');
  add('--> ... ___ *** ~~~ ``` ::: ;;; !!! ??? ... ---');

  // CJK and other scripts
  add('城市里的早晨，天气很好。我们去公园散步吧！');
  add('東京の一日は、朝のコーヒーから始まります。「こんにちは」と言いました。');
  add('안녕하세요, 세계! 오늘은 좋은 날입니다.');
  add('中文English混合text和数字123以及标点，。！？');
  add('Привет, мир! Как дела? Ελληνικά γράμματα. مرحبا بالعالم. שלום עולם.');
  add('नमस्ते दुनिया। สวัสดีครับ ทุกคน. ሰላም ለዓለም');

  // emoji
  add('😀 😃 😄 😁 😆 🥹 🫠 🤖 👾');
  add('👨‍👩‍👧‍👦 family 👩‍💻 coder 🏳️‍🌈 flag 🧑🏽‍🚀 astronaut');
  add('🇩🇪🇫🇷🇯🇵🇺🇸 flags 👍🏻👍🏼👍🏽👍🏾👍🏿 tones');
  add('1️⃣ 2️⃣ #️⃣ ❤️ ♥ ☺️ ✔️ ™ © ®');
  add('emoji😀in😀words and🎉!');

  // whitespace
  for (let n = 1; n <= 12; n++) add(`a${' '.repeat(n)}b`);
  add('\t'); add('\n'); add('\n\n\n'); add('\r\n'); add('\r\n\r\n'); add(' \t \n \t ');
  add('trailing   '); add('   leading'); add('  both  '); add('a \n\nb'); add('a\n \nb');
  add('x\t\ty\t z'); add('line1\nline2\r\nline3\rline4'); add(' '.repeat(100));
  add('\n'.repeat(40)); add('a \u00a0 b\u00a0c'); add('ideographic\u3000space');
  add('nel\u0085here \u0085 x'); add('ls\u2028ps\u2029end'); add('thin\u2009hair\u200a');
  add('mongolian\u180Evowel \u180E! !\u180E \u180E\u180E x'); add('zero\u200Bwidth \u200B');
  add('bom\uFEFFin \uFEFF text'); add('ogham\u1680space');

  // digits
  for (let n = 1; n <= 10; n++) add('1234567890'.slice(0, n));
  for (let n = 1; n <= 10; n++) add(`x${'9876543210'.slice(0, n)} ${'5'.repeat(n)}y`);
  add('3.14159 2.71828 -42 +7 1e10 0x1F 0b1010 1,000,000 10.000,50');
  add('2024-03-17T09:41:07Z +49 30 1234567 (555) 123-4567');
  add('٠١٢٣٤٥٦٧٨٩ ۱۲۳ १२३ １２３ ①②③ Ⅻ ½ ²³');

  // contractions, in every case
  for (const c of ['s', 't', 're', 've', 'm', 'll', 'd']) {
    const forms = new Set([c, c.toUpperCase(), c[0].toUpperCase() + c.slice(1),
      c.length > 1 ? c[0] + c[1].toUpperCase() : c]);
    for (const f of forms) {
      add(`it'${f}`);
      add(`IT'${f} x'${f}y '${f} ''${f}`);
    }
  }
  add("don't can't won't shouldn't've y'all ma'am rock'n'roll o'clock");
  add("it’s curly ’s and it'ſ long s and 'ſt");

  // accented and combining
  add('café cafe\u0301 naïve nai\u0308ve Ångström Zoë résumé');
  add('Tiếng Việt có dấu: Người, được, những.');
  add('Z̷̢̛a̴l̶g̵o̸ t̶e̷x̸t̵ ̶h̷e̵r̴e̸');
  add('ǅungla ǈudi ǋuma ʰʲʷ ꜰ ﬁ ﬂ ß ẞ ı İ');
  add('Größere Änderungen, déjà vu, ¿Dónde está la estación?');

  // long runs
  add('a'.repeat(1000)); add('ab'.repeat(300)); add('!'.repeat(200)); add('7'.repeat(100));
  add('aGVsbG8gd29ybGQgdGhpcyBpcyBiYXNlNjQgZW5jb2RlZCB0ZXh0IGZvciB0ZXN0aW5n'.repeat(8));

  // special tokens, allowed and not
  for (const allow of [true, false]) {
    add(sp, allow);
    add(`Hello${sp}World`, allow);
    add(` ${sp} `, allow);
    add(`${sp}${sp}`, allow);
    add(`<|endoftext ${sp.slice(0, -1)} |>`, allow);
    add(specials.map((s) => `x ${s} y`).join('\n'), allow);
  }

  // prose: the committed corpus of tools/tinymodel, paragraph by paragraph
  const corpus = path.join(__dirname, '..', '..', 'tools', 'tinymodel', 'corpus.txt');
  for (const para of fs.readFileSync(corpus, 'utf8').split(/\n\n+/)) if (para) add(para);
  return texts;
}

// ---- seeded random strings --------------------------------------------------------------------

function mulberry32(a) {
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomStrings(n, excluded) {
  const rnd = mulberry32(seed);
  const int = (lo, hi) => lo + Math.floor(rnd() * (hi - lo + 1));
  const pick = (a) => a[int(0, a.length - 1)];
  const range = (lo, hi) => () => int(lo, hi);
  const oneOf = (cps) => () => pick(cps);
  const WS = [0x9, 0xa, 0xb, 0xc, 0xd, 0x20, 0x85, 0xa0, 0x1680, 0x180e, 0x2000, 0x2005, 0x200a,
    0x200b, 0x2028, 0x2029, 0x202f, 0x205f, 0x2060, 0x3000, 0xfeff];
  // [weight, generator of one code point]
  const pools = [
    [30, range(0x61, 0x7a)], [8, range(0x41, 0x5a)], [6, range(0x30, 0x39)],
    [8, oneOf([...' !"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~'].map((c) => c.codePointAt(0)))],
    [12, oneOf([0x20, 0x20, 0x20, 0x9, 0xa, 0xa, 0xd])], [3, oneOf(WS)],
    [4, range(0xa0, 0xff)], [3, range(0x100, 0x24f)], [2, range(0x250, 0x2ff)],
    [3, range(0x300, 0x36f)], [2, range(0x370, 0x4ff)], [1, range(0x590, 0x6ff)],
    [1, range(0x900, 0xdff)], [6, range(0x4e00, 0x9fff)], [2, range(0x3000, 0x30ff)],
    [2, range(0xac00, 0xd7a3)], [1, range(0xff00, 0xffef)],
    [4, oneOf([0x1f600, 0x1f602, 0x1f44d, 0x1f468, 0x1f469, 0x1f467, 0x1f466, 0x2764, 0x1f3f3])],
    [3, range(0x1f300, 0x1f6ff)], [2, range(0x1f900, 0x1f9ff)], [1, range(0x2600, 0x27bf)],
    [3, oneOf([0x200d, 0xfe0f, 0x1f3fb, 0x1f3fd, 0x1f3ff, 0x20e3])], [1, range(0x1f1e6, 0x1f1ff)],
    [2, range(0x0, 0xffff)], [2, range(0x10000, 0x10ffff)],
  ];
  const total = pools.reduce((s, p) => s + p[0], 0);
  const drawCp = () => {
    for (;;) {
      let w = rnd() * total;
      let k = 0;
      while (w >= pools[k][0]) w -= pools[k++][0];
      const cp = pools[k][1]();
      if ((cp < 0xd800 || cp > 0xdfff) && !excluded.has(cp)) return cp;
    }
  };
  // Whole pieces that random code points rarely make.
  const pieces = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re", "'vE",
    '123456', '   ', '\n\n', ' \n', '\r\n', '//', '</', '|>', '<|',
    ...Object.keys(enc.special_tokens)];
  const out = [];
  for (let i = 0; i < n; i++) {
    const len = rnd() < 0.05 ? int(64, 400) : int(1, 40);
    let s = '';
    for (let k = 0; k < len; k++) s += rnd() < 0.08 ? pick(pieces) : String.fromCodePoint(drawCp());
    out.push([s, rnd() < 0.5]);
  }
  return out;
}

// ---- main -------------------------------------------------------------------------------------

function main() {
  fs.mkdirSync(outDir, { recursive: true });
  const tokens = parseRanks(enc.bpe_ranks);
  const rankOf = new Map();
  tokens.forEach((t, rank) => {
    if (t !== undefined) rankOf.set(t.toString('latin1'), rank);
  });
  const merges = deriveMerges(tokens, rankOf);
  fs.writeFileSync(path.join(outDir, 'tokenizer.json'),
    JSON.stringify(tokenizerJson(tokens, merges)));

  const { excluded, unicode } = excludedCodePoints(classesPath);
  fs.writeFileSync(path.join(outDir, 'excluded.txt'),
    `# code points whose classes differ between PCRE2 (Unicode ${unicode}) and Node ` +
    `(Unicode ${process.versions.unicode})\n${rangesText(excluded).join('\n')}\n`);

  const tt = new Tiktoken(enc.bpe_ranks, enc.special_tokens, enc.pat_str);
  const lines = [];
  const write = (label, [text, allow]) => {
    const ids = allow ? tt.encode(text, 'all') : tt.encode_ordinary(text);
    const hex = Buffer.from(text, 'utf8').toString('hex');
    lines.push(`${label} ${allow ? 1 : 0} ${hex} ${Array.from(ids).join(' ')}`);
  };
  const corpus = fixedCorpus();
  corpus.forEach((c, i) => write(`corpus[${i}]`, c));
  const random = randomStrings(nRandom, excluded);
  random.forEach((c, i) => write(`random[${i}]`, c));
  tt.free();
  fs.writeFileSync(path.join(outDir, 'cases.txt'), `${lines.join('\n')}\n`);
  console.log(`tiktoken_ref: ${encName}: ${tokens.filter((t) => t).length} ranks, ` +
    `${merges.length} merges, ${corpus.length} corpus texts + ${random.length} random strings ` +
    `(seed ${seed}); ${excluded.size} code points left out of random strings ` +
    `(PCRE2 Unicode ${unicode}, Node Unicode ${process.versions.unicode}; ${outDir}/excluded.txt)`);
}

main();
