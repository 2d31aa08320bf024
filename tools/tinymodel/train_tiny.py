#!/usr/bin/python3
"""train_tiny.py — trains the bundled model (models/pie-tiny): a small Llama that has learned
the beginning of corpus.txt (its sections before --until) by heart, so that greedy decoding from
the start of one of its sentences continues the text.

Owns: the model's shapes (PRESET), the training data (windows of the tokenized corpus, with and
without <|begin_of_text|>, some starting at a word without its leading space, as a prompt does),
the PyTorch model used for training (the Llama that the C engine runs: RMSNorm, RoPE in the
rotate_half convention with the llama3 frequency scaling written to config.json, GQA, SwiGLU,
tied embeddings), the optimiser and schedule, greedy samples, and the README.md of the model.
Does not own: config.json / generation_config.json / tokenizer files, the safetensors layout and
the bf16 rounding (gen_tiny_model.py), the tokenizer itself (bpe_train.py, trained on
corpus.txt), the independent float64 reference used to check the export
(tests/python/ref_llama.py).

Usage (the exact command that made models/pie-tiny; see its README.md for the time it took):
  nice -n 10 /usr/bin/python3 tools/tinymodel/train_tiny.py --out models/pie-tiny

Debian's /usr/bin/python3 with python3-torch (CPU) and numpy. Deterministic: the seed fixes the
initial weights and every batch; with the same torch build and thread count the weights are
bit-identical on one machine (other CPUs may round matrix products differently, which moves
weights slightly but not the behaviour)."""

import argparse
import math
import os
import sys
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, HERE)
import bpe_train  # noqa: E402
import gen_tiny_model as gtm  # noqa: E402

# The model's shapes, in gen_tiny_model's preset form (config_json reads these keys). RoPE is
# the tiny preset's llama3 block (θ 10⁴, ×8, low 1, high 4, original 256): at head_dim 32 the
# lowest frequencies are divided by the factor and the middle band is smoothed, so a wrong
# scaling in an engine changes this model's output.
PRESET = dict(
    tok_vocab=2048, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384,
    max_position=1024, rms_eps=1e-5, rope_theta=10000.0,
    rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=256),
    tied=True)
TOKENIZER_STYLE = "llama3"

# Training defaults (each has a command-line option).
DEFAULTS = dict(seed=1234, steps=500, batch=8, seq=128, lr=4e-3, warmup=30, min_lr=0.05,
                threads=2, dtype="bf16", until="How a Hash Table Works")
BOS_FRACTION = 0.5    # windows that start with <|begin_of_text|> (callers may or may not add it)
STRIP_FRACTION = 0.5  # windows whose first word loses its leading space, as a typed prompt has

# Prompts shown in README.md; the test (tests/python/test_bundled_model.py) uses its own.
SAMPLE_PROMPTS = ["Every Saturday the square", "How to Make a Simple Soup",
                  "The baker arrives last, because", "I like to get there before"]
SAMPLE_TOKENS = 40


def log(msg):
    print("train_tiny: " + msg, flush=True)


# ---- data --------------------------------------------------------------------------------------

class Corpus:
    """The token ids of the training text and the tokenizer's byte strings (for decoding)."""

    def __init__(self, tok, text):
        self.tok = tok
        self.ids = bpe_train.encode(tok, text, allow_special=False)
        self.bos, _ = gtm.special_ids(tok)
        self.bytes_of = {i: bpe_train.from_bytelevel(s) for s, i in tok["model"]["vocab"].items()}
        for t in tok.get("added_tokens", []):
            self.bytes_of[t["id"]] = t["content"].encode()
        # For windows that start at a word: the ids of the word (letters only) without its
        # leading space (encoded in one call, one per line, then split at the newline's id).
        spaced = [i for i, b in sorted(self.bytes_of.items())
                  if b.startswith(b" ") and b[1:].isascii() and b[1:].isalpha()]
        words = [self.bytes_of[i][1:].decode("utf-8", "replace") for i in spaced]
        nl = self.encode("\n")
        parts, cur = [], []
        for t in self.encode("\n".join(words)):
            if [t] == nl:
                parts.append(cur)
                cur = []
            else:
                cur.append(t)
        parts.append(cur)
        if len(parts) != len(spaced) or not all(parts):
            raise AssertionError("train_tiny: words did not encode one per line")
        self.stripped = dict(zip(spaced, parts))

    def encode(self, text):
        return bpe_train.encode(self.tok, text, allow_special=False)

    def decode(self, ids):
        return b"".join(self.bytes_of[i] for i in ids).decode("utf-8", "replace")


def make_batch(corpus, gen, batch, seq):
    """[batch, seq + 1] ids: windows of the corpus at random offsets; BOS_FRACTION of them start
    with BOS, STRIP_FRACTION have their first word's leading space removed. Drawn from gen only,
    so the batches are a function of the seed."""
    ids = corpus.ids
    out = torch.empty(batch, seq + 1, dtype=torch.long)
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen).tolist()
    coins = torch.rand(batch, 2, generator=gen).tolist()
    for r, (s, (c_bos, c_strip)) in enumerate(zip(starts, coins)):
        head = []
        if c_bos < BOS_FRACTION:
            head.append(corpus.bos)
        first = ids[s]
        if c_strip < STRIP_FRACTION and first in corpus.stripped:
            head.extend(corpus.stripped[first])
        else:
            head.append(first)
        row = head + ids[s + 1:s + 1 + seq + 1 - len(head)]
        out[r] = torch.tensor(row[:seq + 1])
    return out


# ---- the model ---------------------------------------------------------------------------------

def rope_inv_freq(p):
    """inv_freq [head_dim/2]: θ^(-2i/d), then the llama3 scaling of p["rope"] (three bands by
    wavelength: high frequencies kept, low ones divided by factor, the middle interpolated)."""
    d, r = p["head_dim"], p["rope"]
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    wavelen = 2 * math.pi / inv
    low_wl = r["original_max_position_embeddings"] / r["low_freq_factor"]
    high_wl = r["original_max_position_embeddings"] / r["high_freq_factor"]
    smooth = (r["original_max_position_embeddings"] / wavelen - r["low_freq_factor"]) / (
        r["high_freq_factor"] - r["low_freq_factor"])
    mid = (1 - smooth) * inv / r["factor"] + smooth * inv
    out = torch.where(wavelen > low_wl, inv / r["factor"], inv)
    return torch.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, out)


def weight_names(p):
    """HF checkpoint names and shapes of every trained tensor, in checkpoint order."""
    d, ffn, hd = p["hidden"], p["ffn"], p["head_dim"]
    q, kv = p["heads"] * hd, p["kv_heads"] * hd
    out = [("model.embed_tokens.weight", None)]  # vocab rows: known once the tokenizer is
    for i in range(p["layers"]):
        pre = f"model.layers.{i}."
        out += [(pre + "input_layernorm.weight", (d,)),
                (pre + "self_attn.q_proj.weight", (q, d)),
                (pre + "self_attn.k_proj.weight", (kv, d)),
                (pre + "self_attn.v_proj.weight", (kv, d)),
                (pre + "self_attn.o_proj.weight", (d, q)),
                (pre + "post_attention_layernorm.weight", (d,)),
                (pre + "mlp.gate_proj.weight", (ffn, d)),
                (pre + "mlp.up_proj.weight", (ffn, d)),
                (pre + "mlp.down_proj.weight", (d, ffn))]
    out.append(("model.norm.weight", (d,)))
    return out


class TinyLlama(torch.nn.Module):
    """The Llama forward over [batch, seq] ids, weights kept under their HF names."""

    def __init__(self, p, vocab, gen):
        super().__init__()
        self.p, self.vocab = p, vocab
        self.w = torch.nn.ParameterDict()
        self.names = []
        n_resid = 2 * p["layers"]
        for name, shape in weight_names(p):
            shape = (vocab, p["hidden"]) if shape is None else shape
            if name.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(n_resid)  # residual branches start small (GPT-2's rule)
                t = torch.randn(shape, generator=gen) * std
            self.w[name.replace(".", "/")] = torch.nn.Parameter(t)
            self.names.append(name)
        self.register_buffer("inv_freq", rope_inv_freq(p).float(), persistent=False)

    def W(self, name):
        return self.w[name.replace(".", "/")]

    def rms(self, x, name):
        return self.W(name) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                               self.p["rms_eps"]))

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, ids):
        """ids [B, T] → logits [B, T, vocab] (positions 0..T-1, causal)."""
        p = self.p
        B, T = ids.shape
        H, KV, hd = p["heads"], p["kv_heads"], p["head_dim"]
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = F.embedding(ids, self.W("model.embed_tokens.weight"))
        for i in range(p["layers"]):
            pre = f"model.layers.{i}."
            h = self.rms(x, pre + "input_layernorm.weight")
            q = F.linear(h, self.W(pre + "self_attn.q_proj.weight")).view(B, T, H, hd)
            k = F.linear(h, self.W(pre + "self_attn.k_proj.weight")).view(B, T, KV, hd)
            v = F.linear(h, self.W(pre + "self_attn.v_proj.weight")).view(B, T, KV, hd)
            q = self.rope(q.transpose(1, 2), cos, sin)                      # [B, H, T, hd]
            k = self.rope(k.transpose(1, 2), cos, sin).repeat_interleave(H // KV, dim=1)
            v = v.transpose(1, 2).repeat_interleave(H // KV, dim=1)        # head h ← kv h/(H/KV)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * hd),
                             self.W(pre + "self_attn.o_proj.weight"))
            h = self.rms(x, pre + "post_attention_layernorm.weight")
            x = x + F.linear(F.silu(F.linear(h, self.W(pre + "mlp.gate_proj.weight"))) *
                             F.linear(h, self.W(pre + "mlp.up_proj.weight")),
                             self.W(pre + "mlp.down_proj.weight"))
        x = self.rms(x, "model.norm.weight")
        return F.linear(x, self.W("model.embed_tokens.weight"))  # tied lm_head

    def round_to(self, dtype):
        """Rounds every weight to what the checkpoint stores (bf16/f16: nearest even), so the
        samples and checks below describe the written model, not the f32 one."""
        tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
        with torch.no_grad():
            for t in self.w.values():
                t.copy_(t.to(tdt).float())

    def arrays(self):
        return [(n, self.W(n).detach().numpy().astype(np.float32)) for n in self.names]


@torch.no_grad()
def greedy(model, ids, steps):
    """Greedy continuation (argmax, ties to the lowest id) of ids, recomputing the prefix."""
    ids = list(ids)
    out = []
    for _ in range(steps):
        nxt = int(torch.argmax(model(torch.tensor([ids]))[0, -1]))
        ids.append(nxt)
        out.append(nxt)
    return out


@torch.no_grad()
def next_token_accuracy(model, corpus, seq):
    """Fraction of the corpus's tokens predicted exactly (argmax) from the tokens before them,
    in consecutive windows of seq tokens (the first token of each window is not scored)."""
    ids = corpus.ids
    hit = total = 0
    for s in range(0, len(ids) - 1, seq):
        w = torch.tensor([ids[s:s + seq + 1]])
        pred = model(w[:, :-1]).argmax(-1)
        hit += int((pred == w[:, 1:]).sum())
        total += w.shape[1] - 1
    return hit / total


# ---- training ----------------------------------------------------------------------------------

def lr_at(step, a):
    """Linear warm-up, then cosine decay to min_lr × lr."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr + (1 - a.min_lr) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, corpus, a):
    gen = torch.Generator().manual_seed(a.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0, losses = time.time(), []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        batch = make_batch(corpus, gen, a.batch, a.seq)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, model.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        if (step + 1) % 50 == 0 or step + 1 == a.steps:
            el = time.time() - t0
            log(f"step {step + 1}/{a.steps} loss {np.mean(losses[-50:]):.3f} "
                f"lr {lr_at(step, a):.2e} {el:.0f} s (~{el / (step + 1) * a.steps:.0f} s total)")
    return float(np.mean(losses[-50:])), time.time() - t0


# ---- checks and the directory ------------------------------------------------------------------

def check_against_reference(model, out_dir, corpus):
    """Loads the written directory with the float64 reference (tests/python/ref_llama.py, written
    from the HF definition independently of this file) and compares logits over one window:
    catches a wrong tensor name, layout, RoPE or config. Returns the relative error."""
    ref_dir = os.path.join(ROOT, "tests", "python")
    if not os.path.exists(os.path.join(ref_dir, "ref_llama.py")):
        log(f"{ref_dir}/ref_llama.py is missing: export not cross-checked")
        return None
    sys.path.insert(0, ref_dir)
    import ref_llama  # noqa: E402 (lazy: only this check needs it)
    ref = ref_llama.LlamaModel.from_dir(out_dir)
    ids = [corpus.bos] + corpus.ids[:63]
    want = ref.dense_logits(ids).numpy()
    with torch.no_grad():
        got = model(torch.tensor([ids]))[0].double().numpy()
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    if err > 1e-4:
        sys.exit(f"train_tiny: the written model disagrees with ref_llama: relative logits "
                 f"error {err:.2e} > 1e-4 (export or architecture mismatch)")
    return err


def write_weights(tmp, model, tok, a):
    meta = {"format": "pt", "generator": "pie-c tools/tinymodel/train_tiny.py",
            "preset": "pie-tiny", "seed": str(a.seed), "steps": str(a.steps)}
    gtm.write_model_files(tmp, PRESET, model.vocab, True, a.dtype, "scaling", tok,
                          TOKENIZER_STYLE)
    return gtm.write_safetensors_arrays(os.path.join(tmp, "model.safetensors"), model.arrays(),
                                        a.dtype, meta)


def readme(a, model, stats, samples):
    """models/pie-tiny/README.md: what the model is, how it was made, and what it does."""
    p, r = PRESET, PRESET["rope"]
    n_params = sum(int(np.prod(t.shape)) for t in model.parameters())
    lines = [
        "# pie-tiny — the bundled model",
        "",
        "A 4-layer Llama trained by `tools/tinymodel/train_tiny.py` on the beginning of",
        f"`tools/tinymodel/corpus.txt` (the corpus shipped in this repo): its first "
        f"{stats['chars']:,} characters, the {len(stats['titles'])} sections before "
        f"\"{a.until}\" ({', '.join(stats['titles'])}). It has learned that text by heart: "
        "given the start of "
        "one of its sentences, greedy decoding continues the sentence as the corpus does. It "
        "knows nothing else; other prompts drift into phrases of that text. "
        "`deploy/local/pie-local.sh --model models/pie-tiny` serves it.",
        "",
        "## Regenerate",
        "",
        "```",
        "nice -n 10 /usr/bin/python3 tools/tinymodel/train_tiny.py --out models/pie-tiny",
        "```",
        "",
        f"Debian's python3-torch on the CPU, {a.threads} threads, {stats['train_s'] / 60:.0f} "
        "minutes on the 2-core CI machine (shared with other builds). Deterministic: seed "
        f"{a.seed} fixes the initial weights and every batch; on one machine with one torch "
        "build the file is bit-identical, elsewhere matrix products may round differently and "
        "the weights move slightly, not the behaviour. The command also rewrites this README "
        "with the new numbers and samples.",
        "",
        "## Model",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | LlamaForCausalLM: RMSNorm, RoPE (θ {p['rope_theta']:g}, llama3 scaling "
        f"×{r['factor']:g}, low {r['low_freq_factor']:g}, high {r['high_freq_factor']:g}, "
        f"original {r['original_max_position_embeddings']}), GQA, SwiGLU, tied embeddings |",
        f"| shapes | vocab {model.vocab}, hidden {p['hidden']}, {p['layers']} layers, "
        f"{p['heads']} heads / {p['kv_heads']} KV heads of {p['head_dim']}, ffn {p['ffn']} |",
        f"| parameters | {n_params:,} |",
        f"| weights | `model.safetensors`, {a.dtype}, {stats['bytes'] / 1e6:.1f} MB |",
        f"| tokenizer | byte-level BPE ({TOKENIZER_STYLE} style, {model.vocab} ids) trained by "
        "`bpe_train.py` on the same corpus; BOS `<|begin_of_text|>` |",
        f"| trained context | {a.seq} tokens (positions beyond it were never seen) |",
        "",
        "## Training",
        "",
        f"The training text is {len(stats['corpus_ids']):,} tokens. Each step takes "
        f"{a.batch} windows of {a.seq} + 1 tokens at random offsets; half of them start with "
        "`<|begin_of_text|>` and half have their first word without its leading space (as a "
        "typed prompt has), so prompts work with or without BOS. AdamW (β 0.9/0.95, no weight "
        f"decay), learning rate {a.lr:g} with {a.warmup} warm-up steps and cosine decay to "
        f"{a.min_lr:g}×, gradient norm clipped at 1, {a.steps} steps, f32; the weights are then "
        f"rounded to {a.dtype}.",
        "",
        f"Result: training loss {stats['loss']:.3f} nats/token over the last 50 steps; with the "
        f"stored {a.dtype} weights the argmax of the next-token distribution is the corpus's "
        f"next token for {100 * stats['accuracy']:.1f} % of its tokens (windows of {a.seq}). "
        "The stored model's logits match the float64 reference of "
        f"`tests/python/ref_llama.py` to a relative error of {stats['ref_err']:.1e}.",
        "",
        "## Sample greedy outputs",
        "",
        f"Prompt without BOS, {SAMPLE_TOKENS} tokens, greedy (the `→` marks where the model "
        "starts):",
        "",
    ]
    for prompt, text in samples:
        lines += ["```", f"{prompt}→{text}", "```", ""]
    lines += [
        "`tests/python/test_bundled_model.py` checks this behaviour on the stored weights (with "
        "the reference and, when built, the C engine through `pie-engine-probe`).",
        ""]
    out, code = [], False
    for line in lines:  # wrap prose to 100 columns; code blocks and tables stay as they are
        code ^= line.startswith("```")
        keep = code or line.startswith(("```", "|", "#")) or len(line) <= 100
        out.append(line if keep else textwrap.fill(line, 100, break_on_hyphens=False))
    return "\n".join(out)


def section_titles(text):
    """Headings of corpus.txt: paragraphs of one short line that end in a letter or digit."""
    return [p for p in text.split("\n\n")
            if p and "\n" not in p and len(p) < 60 and p[-1].isalnum()]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the bundled tiny Llama on corpus.txt.")
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "pie-tiny"))
    for k, v in DEFAULTS.items():
        if k == "dtype":
            ap.add_argument("--dtype", choices=sorted(gtm.DTYPES), default=v)
        else:
            ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--tokenizer-cache", default="",
                    help="directory caching the trained tokenizer (gen_tiny_model's cache)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch < 1 or a.seq < 8 or a.threads < 1:
        ap.error("--steps, --batch, --threads must be >= 1 and --seq >= 8")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_all = time.time()
    gtm.QUIET = True
    tok = gtm.make_tokenizer(TOKENIZER_STYLE, PRESET["tok_vocab"], a.tokenizer_cache)
    with open(gtm.CORPUS, encoding="utf-8") as f:
        text = f.read()
    if a.until:
        end = text.find("\n\n" + a.until + "\n")
        if end < 0:
            ap.error(f"--until {a.until!r}: no such heading (a line of its own after a blank "
                     f"line) in {gtm.CORPUS}")
        text = text[:end + 2]
    corpus = Corpus(tok, text)
    vocab = gtm.tokenizer_size(tok)
    log(f"training text: {len(text)} characters, {len(corpus.ids)} tokens; vocab {vocab}")

    model = TinyLlama(PRESET, vocab, torch.Generator().manual_seed(a.seed))
    n_params = sum(int(np.prod(t.shape)) for t in model.parameters())
    log(f"model: {n_params:,} parameters; {a.steps} steps of {a.batch} x {a.seq} tokens, "
        f"{a.threads} threads")
    loss, train_s = train(model, corpus, a)
    model.round_to(a.dtype)
    acc = next_token_accuracy(model, corpus, a.seq)
    log(f"trained in {train_s:.0f} s: loss {loss:.3f}, next-token accuracy {100 * acc:.1f} % "
        f"({a.dtype} weights)")

    samples = []
    for prompt in SAMPLE_PROMPTS:
        cont = corpus.decode(greedy(model, corpus.encode(prompt), SAMPLE_TOKENS))
        samples.append((prompt, cont))
        log(f"sample: {prompt!r} → {cont!r}")

    stats = dict(loss=loss, accuracy=acc, train_s=train_s, corpus_ids=corpus.ids,
                 chars=len(text), titles=section_titles(text))

    def fill(tmp):
        stats["bytes"] = write_weights(tmp, model, tok, a)
        stats["ref_err"] = check_against_reference(model, tmp, corpus) or float("nan")
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(readme(a, model, stats, samples))

    gtm.write_dir_atomically(a.out, fill)
    log(f"wrote {os.path.abspath(a.out)}: {stats['bytes'] / 1e6:.1f} MB of {a.dtype} weights, "
        f"reference logits error {stats['ref_err']:.1e}, {time.time() - t_all:.0f} s in all")


if __name__ == "__main__":
    main()
