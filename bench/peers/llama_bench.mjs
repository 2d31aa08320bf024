// llama_bench.mjs — llama.cpp (through node-llama-cpp) doing bench_engine's decode and prefill.
//
// Owns: the llama.cpp half of bench/peers/run.sh, built to mirror bench/engine/bench_engine.c:
//   decode b=N @C  N sequences, each holding the same C-token context (sequence 0 is prefilled,
//                  its state saved and loaded into the others, as bench_engine copies pages),
//                  then 1 warm-up + --steps steps of one token per sequence, all N in one batch
//                  (node-llama-cpp gathers the sequences' evaluations into one llama_decode);
//                  each step computes the logits of every sequence and samples its next token.
//                  tok/s = N / median step time (best in brackets).
//   prefill P      one evaluation of P tokens in a fresh sequence, logits of the last only, after
//                  the decode runs have warmed the weights; tok/s = P / its time.
// Token ids follow bench_engine's pseudo-random sequence (ids < 4096, what the llama-3.2-1b
// preset's tokenizer knows); the values do not change the work.
// llama.cpp's own defaults are kept (F16 KV cache, flash attention "auto") unless --kv / --fa
// say otherwise: this is the engine as its users would run it.
//
// Usage: node bench/peers/llama_bench.mjs --check   (setup.sh: the prebuilt CPU build loads here)
//        node bench/peers/llama_bench.mjs --gguf FILE [--threads 2] [--context 512]
//            [--sequences 1,8,32] [--prefill 128,512] [--steps 8] [--kv f16|f32] [--fa auto|on|off]
// Ends with the process's CPU share (CPU seconds / (wall seconds * threads)), as bench_engine does.
// Prints one JSON line per measurement: {"measure": "decode b=8 @512" | "prefill 512", "tps": ..,
// "best_tps": .., "seconds": ..}, after a line about the model and the settings.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

function args() {
    const a = {threads: 2, context: 512, sequences: [1, 8, 32], prefill: [128, 512], steps: 8, kv: null, fa: "auto"};
    const v = process.argv.slice(2);
    const list = (x) => (x === "" ? [] : x.split(",").map(Number));
    for (let i = 0; i < v.length; i += 2) {
        const k = v[i], x = v[i + 1];
        if (k === "--check") { a.check = true; i--; }
        else if (k === "--gguf") a.gguf = x;
        else if (k === "--threads") a.threads = Number(x);
        else if (k === "--context") a.context = Number(x);
        else if (k === "--sequences") a.sequences = list(x);
        else if (k === "--prefill") a.prefill = list(x);
        else if (k === "--steps") a.steps = Number(x);
        else if (k === "--kv") a.kv = x.toUpperCase();
        else if (k === "--fa") a.fa = x;
        else throw new Error(`llama_bench.mjs: unknown option ${k}`);
    }
    if (!a.gguf && !a.check) throw new Error("llama_bench.mjs: --gguf is required");
    return a;
}

// bench_engine's embed_run ids: (seed * 2654435761 + pos * 40503) mod 4096 (32-bit arithmetic).
function ids(n, pos0, seed, vocab) {
    const v = Math.min(vocab, 4096);
    return Array.from({length: n}, (_, i) => ((Math.imul(seed, 2654435761) + Math.imul(pos0 + i, 40503)) >>> 0) % v);
}

const now = () => Number(process.hrtime.bigint()) * 1e-9;
const median = (v) => { const s = [...v].sort((x, y) => x - y); const n = s.length; return n % 2 ? s[n >> 1] : (s[n / 2 - 1] + s[n / 2]) / 2; };

function contextOptions(a, extra) {
    const o = {threads: {ideal: a.threads, min: a.threads}, ...extra};
    if (a.fa !== "auto") o.flashAttention = a.fa === "on";
    if (a.kv) { o.experimentalKvCacheKeyType = a.kv; o.experimentalKvCacheValueType = a.kv; }
    return o;
}

async function decode(model, a, n, vocab) {
    const ctx = await model.createContext(contextOptions(a, {sequences: n, contextSize: a.context + a.steps + 8,
        batchSize: Math.max(512, n)}));
    const seqs = Array.from({length: n}, () => ctx.getSequence());
    await seqs[0].evaluateWithoutGeneratingNewTokens(ids(a.context, 0, 1, vocab));
    if (n > 1) {
        const file = path.join(os.tmpdir(), `llama_bench_${process.pid}.state`);
        await seqs[0].saveStateToFile(file);
        for (let b = 1; b < n; b++) await seqs[b].loadStateFromFile(file, {acceptRisk: true});
        fs.rmSync(file, {force: true});
    }
    const t = [];
    for (let step = 0; step <= a.steps; step++) {
        const pos = a.context + step;
        const t0 = now();
        await Promise.all(seqs.map((s, b) => s.controlledEvaluate([[ids(1, pos, 7 + b, vocab)[0], {generateNext: {token: true}}]])));
        if (step > 0) t.push(now() - t0);
    }
    const res = {measure: `decode b=${n} @${a.context}`, tps: n / median(t), best_tps: n / Math.min(...t), seconds: t};
    await ctx.dispose();
    return res;
}

async function prefill(model, a, p, vocab) {
    const ctx = await model.createContext(contextOptions(a, {sequences: 1, contextSize: p + 8, batchSize: Math.max(512, p)}));
    const seq = ctx.getSequence();
    const toks = ids(p, 0, 1, vocab);
    const input = toks.map((x, i) => (i === p - 1 ? [x, {generateNext: {token: true}}] : x));
    const t0 = now();
    await seq.controlledEvaluate(input);
    const dt = now() - t0;
    await ctx.dispose();
    return {measure: `prefill ${p}`, tps: p / dt, best_tps: p / dt, seconds: [dt]};
}

async function main() {
    const a = args();
    const wall0 = now(), cpu0 = process.cpuUsage();
    const llama = await getLlama({gpu: false, build: "never", maxThreads: a.threads, logLevel: LlamaLogLevel.error});
    if (a.check) {
        console.log(`node-llama-cpp ready (${llama.buildType} build, CPU): ${llama.systemInfo}`);
        process.exit(0);
    }
    const t0 = now();
    const model = await llama.loadModel({modelPath: a.gguf, gpuLayers: 0});
    const vocab = Number(model.fileInfo.metadata?.llama?.vocab_size ?? 4096);
    console.log(`llama.cpp (node-llama-cpp ${JSON.parse(fs.readFileSync(new URL("node_modules/node-llama-cpp/package.json", import.meta.url))).version}, ` +
        `${llama.buildType} build, ${llama.gpu === false ? "CPU" : llama.gpu}): ${path.basename(a.gguf)} loaded in ${(now() - t0).toFixed(2)} s; ` +
        `llama.cpp ${llama.llamaCppRelease.release}; system info: ${llama.systemInfo}\n  threads ${a.threads}; KV cache ${a.kv ?? "F16 (default)"}; flash attention ${a.fa}`);
    for (const n of a.sequences) console.log(JSON.stringify(await decode(model, a, n, vocab)));
    for (const p of a.prefill) console.log(JSON.stringify(await prefill(model, a, p, vocab)));
    await model.dispose();
    const cpu = process.cpuUsage(cpu0), wall = now() - wall0, cpuS = (cpu.user + cpu.system) * 1e-6;
    console.log(`CPU share of this run: ${cpuS.toFixed(0)} s of CPU in ${wall.toFixed(0)} s, ` +
        `${(100 * cpuS / (wall * a.threads)).toFixed(0)}% of ${a.threads} threads (well below 100% means other load ` +
        `on the machine slowed it, or threads waited)`);
    process.exit(0);
}

main().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
