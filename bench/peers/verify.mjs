// verify.mjs — checks a GGUF written by tools/gguf/hf_to_gguf.py against the engine it came from.
//
// Owns: the comparison of llama.cpp (through node-llama-cpp) with Pie-C's CPU engine (through
// pie-engine-probe, tools/engine-probe/PROTOCOL.md) on one model:
//   tokenization  llama.cpp's tokenize(text) of each text == Pie-C's tok_encode ids (no BOS,
//                 no special-token parsing on either side);
//   next token    for each prompt (BOS + the text's ids) the full next-token distribution at the
//                 last position: softmax of each side's raw logits (temperature 1, no sampler).
//                 Passes when both sides' top-1 agree (or, where the engine's top two are closer
//                 than the logit tolerance, when llama.cpp's top-1 is one of the engine's near-tied
//                 ones) and max |p_llama - p_pie| <= --prob-tol over the whole vocabulary.
//
// Tolerances (defaults): max |Δp| <= 1e-6 (--prob-tol), max |Δlogit| <= 1e-4 (--logit-tol;
// also the width of a "near tie" for top-1). Both engines compute in f32 here: an f32 checkpoint,
// llama.cpp's KV cache set to F32 and its flash attention off (with flash attention on, its CPU
// path rounds through f16 and the logits move by ~2e-3 from a float64 reference of the same
// model, while the engine and llama.cpp without it are both within ~3e-6 of that reference).
// What remains is the order of f32 sums (blocked, threaded GEMMs; different softmax and RMS-norm
// reductions): ~6e-6 in the logits of the small preset, ~2e-7 in the probabilities; the
// tolerances leave a factor ~15 above that. A wrong conversion (Q/K rows not permuted, missing
// rope_freqs, gate and up swapped, a wrong eps) moves logits by 1e-2 or more.
//
// Usage: node bench/peers/verify.mjs --gguf FILE --model DIR --probe PIE_ENGINE_PROBE
//                                    [--threads 2] [--prob-tol 1e-4] [--logit-tol 1e-3]
// Exit status 0 when every check passed, 1 otherwise.
import {execFileSync} from "node:child_process";
import path from "node:path";
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "int main(void) { return 0; }  // C code with  two spaces",
    "Numbers 12345 and 3.14159, UPPER lower MiXeD; punctuation!?",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂 and tabs\tand\nnewlines.",
];

function args() {
    const a = {threads: 2, probTol: 1e-6, logitTol: 1e-4};
    const v = process.argv.slice(2);
    for (let i = 0; i < v.length; i += 2) {
        const k = v[i], x = v[i + 1];
        if (k === "--gguf") a.gguf = x;
        else if (k === "--model") a.model = x;
        else if (k === "--probe") a.probe = x;
        else if (k === "--threads") a.threads = Number(x);
        else if (k === "--prob-tol") a.probTol = Number(x);
        else if (k === "--logit-tol") a.logitTol = Number(x);
        else throw new Error(`verify.mjs: unknown option ${k}`);
    }
    if (!a.gguf || !a.model || !a.probe) throw new Error("verify.mjs: --gguf, --model and --probe are required");
    return a;
}

function probe(a, ops) {
    const out = execFileSync(a.probe, ["--model", a.model, "--threads", String(a.threads)],
        {input: JSON.stringify({ops}), maxBuffer: 1 << 30});
    const doc = JSON.parse(out);
    doc.results.forEach((r, i) => {
        if (r.error) throw new Error(`pie-engine-probe: ops[${i}] (${ops[i].op}): ${r.error}`);
    });
    return doc;
}

function softmax(logits) {
    let m = -Infinity;
    for (const x of logits) m = Math.max(m, x);
    let s = 0;
    const p = logits.map((x) => { const e = Math.exp(x - m); s += e; return e; });
    return p.map((x) => x / s);
}

function argmax(v) {
    let b = 0;
    for (let i = 1; i < v.length; i++) if (v[i] > v[b]) b = i;
    return b;
}

// Pie-C: each prompt prefilled into its own pages, the logits of its last position.
function pieLogits(a, prompts, pageSize) {
    const ops = [];
    let page = 0, slot = 0;
    for (const ids of prompts) {
        const n = ids.length, np = Math.ceil(n / pageSize);
        const slots = ids.map((_, i) => slot + i);
        ops.push({op: "embed", slots, tokens: ids, positions: ids.map((_, i) => i)});
        ops.push({op: "forward", items: [{kv_pages: Array.from({length: np}, (_, i) => page + i),
            kv_last_page_len: n - (np - 1) * pageSize, append_kv: true, in_slots: slots,
            out_slots: [slot + n - 1]}]});
        ops.push({op: "logits", slot: slot + n - 1});
        page += np;
        slot += n;
    }
    return probe(a, ops).results.filter((_, i) => i % 3 === 2).map((r) => r.logits);
}

async function main() {
    const a = args();
    let ok = true;
    const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
    const model = await llama.loadModel({modelPath: a.gguf, gpuLayers: 0});
    const tokenizer = path.join(a.model, "tokenizer.json");

    // tokenization
    const pieTok = probe(a, TEXTS.map((text) => ({op: "tokenize", tokenizer, text}))).results.map((r) => r.ids);
    const info = probe(a, []).info;
    TEXTS.forEach((text, i) => {
        const l = Array.from(model.tokenize(text, false));
        const same = l.length === pieTok[i].length && l.every((x, j) => x === pieTok[i][j]);
        console.log(`tokenize ${same ? "same" : "DIFFERENT"} (${l.length} ids): ${JSON.stringify(text)}`);
        if (!same) {
            console.log(`  llama.cpp ${JSON.stringify(l)}\n  pie-c     ${JSON.stringify(pieTok[i])}`);
            ok = false;
        }
    });

    // next-token distributions: BOS + the text's ids (Pie-C's ids, so that a tokenizer
    // difference does not hide behind this check)
    const prompts = pieTok.map((ids) => [info.bos_token_id, ...ids]);
    const pie = pieLogits(a, prompts, info.kv_page_size);
    const ctx = await model.createContext({contextSize: 512, threads: a.threads,
        flashAttention: false,
        experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32"});
    const seq = ctx.getSequence();
    console.log(`\n| prompt | tokens | top-1 pie / llama.cpp | p(top-1) pie / llama.cpp | max |Δp| | max |Δlogit| | logit range | verdict |`);
    console.log(`| --- | --- | --- | --- | --- | --- | --- | --- |`);
    for (let k = 0; k < prompts.length; k++) {
        const ids = prompts[k];
        await seq.clearHistory();
        const input = ids.map((t, i) => (i === ids.length - 1 ? [t, {generateNext: {logits: true}}] : t));
        const res = await seq.controlledEvaluate(input);
        const lmap = res[ids.length - 1].next.logits;
        const ll = new Array(info.vocab_size).fill(-Infinity);
        for (const [t, v] of lmap) ll[t] = v;
        const pl = pie[k];
        const pp = softmax(pl), lp = softmax(ll);
        let dp = 0, dl = 0, lo = Infinity, hi = -Infinity;
        for (let i = 0; i < pl.length; i++) {
            dp = Math.max(dp, Math.abs(pp[i] - lp[i]));
            dl = Math.max(dl, Math.abs(pl[i] - ll[i]));
            lo = Math.min(lo, pl[i]);
            hi = Math.max(hi, pl[i]);
        }
        const tp = argmax(pl), tl = argmax(ll);
        // near ties on the engine's side: ids whose logit is within logitTol of the top
        const tied = pl.map((x, i) => [x, i]).filter(([x]) => pl[tp] - x <= a.logitTol).map(([, i]) => i);
        const top1 = tp === tl || tied.includes(tl);
        const pass = top1 && dp <= a.probTol && dl <= a.logitTol;
        ok &&= pass;
        console.log(`| ${k} | ${ids.length} | ${tp} / ${tl} | ${pp[tp].toFixed(6)} / ${lp[tl].toFixed(6)} | ` +
            `${dp.toExponential(2)} | ${dl.toExponential(2)} | ${lo.toFixed(3)} .. ${hi.toFixed(3)} | ${pass ? "ok" : "FAIL"} |`);
    }
    console.log(`\n${ok ? "PASS" : "FAIL"}: tokenization equal; top-1 equal (ties within ${a.logitTol}), ` +
        `max |Δp| <= ${a.probTol}, max |Δlogit| <= ${a.logitTol}`);
    await ctx.dispose();
    await model.dispose();
    process.exit(ok ? 0 : 1);
}

main().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
