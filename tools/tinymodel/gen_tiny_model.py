#!/usr/bin/python3
"""gen_tiny_model.py — writes a deterministic Llama model directory in the Hugging Face layout.

Owns: the size presets, the weight initialisation (deterministic from --seed and each tensor's
name), the safetensors writer (single file or shards with model.safetensors.index.json), the
f32 → bf16/f16 conversion, config.json / generation_config.json / tokenizer_config.json, and
the choice of tokenizer. Does not own: training the tokenizer (bpe_train.py, trained on
corpus.txt; while that module is absent a pure byte-level tokenizer is written instead).
train_tiny.py (the bundled trained model) reuses make_tokenizer, write_model_files,
write_safetensors_arrays and write_dir_atomically from here.

Usage:
  gen_tiny_model.py --out DIR [--preset tiny|small|llama-3.2-1b|llama-3.1-8b] [--dtype f32|bf16|f16]
                    [--seed N] [--tied|--untied] [--shards N]
                    [--rope-style scaling|parameters|none] [--tokenizer-style llama3|gpt2]
                    [--tokenizer-vocab N] [--tokenizer-cache DIR] [--quiet]

Debian's /usr/bin/python3 with numpy is all it needs. The directory is written next to DIR
and renamed into place at the end, so a reader never sees half a model. See README.md.
"""

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus.txt")
BPE_MODULE = os.path.join(HERE, "bpe_train.py")

# Sizes of each preset. "tok_vocab" is what the tokenizer is trained to; "vocab_size" (when
# given) pads the model's vocabulary beyond it (llama-3.2-1b: real shapes, small tokenizer).
PRESETS = {
    "tiny": dict(
        tok_vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=172,
        max_position=2048, rms_eps=1e-5, rope_theta=10000.0,
        # Scaling reaches the middle frequencies at this head_dim: dims 0-2 keep their
        # frequency, 3 is smoothed, 4-7 are divided by the factor.
        rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=256),
        tied=True),
    "small": dict(
        tok_vocab=2048, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, ffn=688,
        max_position=4096, rms_eps=1e-5, rope_theta=500000.0,
        rope=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192),
        tied=False),
    # Exactly the shapes and hyper-parameters of meta-llama/Llama-3.2-1B.
    "llama-3.2-1b": dict(
        tok_vocab=4096, vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8,
        head_dim=64, ffn=8192, max_position=131072, rms_eps=1e-5, rope_theta=500000.0,
        rope=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192),
        tied=True),
    # Exactly the shapes and hyper-parameters of meta-llama/Llama-3.1-8B (16 GB in bf16: made on
    # the GPU machine for the cuda backend's checks, never at build time).
    "llama-3.1-8b": dict(
        tok_vocab=4096, vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
        head_dim=128, ffn=14336, max_position=131072, rms_eps=1e-5, rope_theta=500000.0,
        rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192),
        tied=False),
}

DTYPES = {  # --dtype → (safetensors name, element bytes, config name)
    "f32": ("F32", 4, "float32"),
    "bf16": ("BF16", 2, "bfloat16"),
    "f16": ("F16", 2, "float16"),
}

# Special tokens after the regular vocabulary, in bpe_train.py's order (both styles use them).
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>"]
TOKENIZER_STYLES = ["gpt2", "llama3"]

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHUNK_ELEMS = 1 << 22  # values generated per step: bounds memory for the 1B preset
QUIET = False


def log(msg):
    if not QUIET:
        print("gen_tiny_model: " + msg, flush=True)


# ---- tokenizer ---------------------------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2's byte → printable character map used by every byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def byte_level_tokenizer(style):
    """A complete tokenizer.json with the 256 byte tokens, no merges, and the special tokens."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    added = [dict(id=256 + i, content=s, single_word=False, lstrip=False, rstrip=False,
                  normalized=False, special=True) for i, s in enumerate(SPECIALS)]
    if style == "llama3":
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}
        bos = SPECIALS[0]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}}}
    else:
        pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pre, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": style == "llama3",
                  "vocab": vocab, "merges": []},
    }


def load_trainer():
    """bpe_train.train_bpe, or None (with the reason logged) when it cannot be used yet."""
    if not os.path.exists(BPE_MODULE) or not os.path.exists(CORPUS):
        missing = BPE_MODULE if not os.path.exists(BPE_MODULE) else CORPUS
        log(f"{missing} is missing: writing a pure byte-level tokenizer.json "
            "(256 byte tokens + special tokens, no merges)")
        return None
    sys.dont_write_bytecode = True  # keep the source tree clean
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    try:
        import bpe_train  # noqa: E402 (lazy on purpose)
    except ImportError as e:
        log(f"cannot import bpe_train ({e}): writing a pure byte-level tokenizer.json")
        return None
    train = getattr(bpe_train, "train_bpe", None)
    if train is None:
        log("bpe_train has no train_bpe(): writing a pure byte-level tokenizer.json")
        return None
    return train


def make_tokenizer(style, vocab, cache_dir):
    """The tokenizer.json dict: trained by bpe_train (cached by the hash of its inputs)."""
    train = load_trainer()
    if train is None:
        return byte_level_tokenizer(style)
    h = hashlib.sha256()
    for path in (BPE_MODULE, CORPUS):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(f"{style}:{vocab}".encode())
    cached = os.path.join(cache_dir, f"{style}-{vocab}-{h.hexdigest()[:16]}.json") \
        if cache_dir else None
    if cached and os.path.exists(cached):
        with open(cached, encoding="utf-8") as f:
            return json.load(f)
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    t0 = time.time()
    tok = train(text, vocab, style=style)
    log(f"trained a {style} BPE tokenizer of {tokenizer_size(tok)} ids in "
        f"{time.time() - t0:.2f} s")
    if cached:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cached}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False)
        os.replace(tmp, cached)  # atomic: parallel builds may race here
    return tok


def tokenizer_size(tok):
    """Number of ids the tokenizer uses: 1 + the largest id of its vocabulary or added tokens."""
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def token_id(tok, content):
    for t in tok.get("added_tokens", []):
        if t["content"] == content:
            return t["id"]
    return tok["model"]["vocab"].get(content)


def special_names(tok):
    """(bos, [eos...]) token strings: GPT-2's <|endoftext|> for both when the tokenizer has it,
    else Llama 3's <|begin_of_text|> and <|end_of_text|>, <|eot_id|>."""
    if token_id(tok, "<|endoftext|>") is not None:
        return "<|endoftext|>", ["<|endoftext|>"]
    return "<|begin_of_text|>", ["<|end_of_text|>", "<|eot_id|>"]


def special_ids(tok):
    """(bos id, eos id or list of ids) as config.json writes them; None when absent."""
    bos_name, eos_names = special_names(tok)
    bos = token_id(tok, bos_name)
    eos = [i for i in (token_id(tok, n) for n in eos_names) if i is not None]
    return bos, (eos if len(eos) > 1 else (eos[0] if eos else None))


# ---- weights -----------------------------------------------------------------------------------

def tensor_specs(p, vocab, tied):
    """[(name, shape, std, mean)] in HF checkpoint order.

    Scales keep activations sane: q/k/v/gate/up have std 1/sqrt(fan_in), so their outputs are
    unit-scale from a normalised input (attention scores have std ~1: attention is neither
    uniform nor one-hot). The embedding has std s_e = 2/sqrt(hidden), and o/down are scaled so
    that each branch adds to the residual stream at that same scale (down by 1.5 more for the
    ~0.6 rms of silu(gate)*up). Logits (normalised hidden · lm_head or the tied embedding) then
    have std ~2: peaked enough for greedy decoding to be unambiguous, flat enough for sampling
    tests. Norm weights are 1 ± 0.05."""
    d, ffn, hd = p["hidden"], p["ffn"], p["head_dim"]
    q, kv = p["heads"] * hd, p["kv_heads"] * hd
    s_e = 2.0 / np.sqrt(d)
    specs = [("model.embed_tokens.weight", (vocab, d), s_e, 0.0)]
    for i in range(p["layers"]):
        pre = f"model.layers.{i}."
        specs += [
            (pre + "input_layernorm.weight", (d,), 0.05, 1.0),
            (pre + "self_attn.q_proj.weight", (q, d), 1 / np.sqrt(d), 0.0),
            (pre + "self_attn.k_proj.weight", (kv, d), 1 / np.sqrt(d), 0.0),
            (pre + "self_attn.v_proj.weight", (kv, d), 1 / np.sqrt(d), 0.0),
            (pre + "self_attn.o_proj.weight", (d, q), s_e / np.sqrt(q), 0.0),
            (pre + "post_attention_layernorm.weight", (d,), 0.05, 1.0),
            (pre + "mlp.gate_proj.weight", (ffn, d), 1 / np.sqrt(d), 0.0),
            (pre + "mlp.up_proj.weight", (ffn, d), 1 / np.sqrt(d), 0.0),
            (pre + "mlp.down_proj.weight", (d, ffn), 1.5 * s_e / np.sqrt(ffn), 0.0),
        ]
    specs.append(("model.norm.weight", (d,), 0.05, 1.0))
    if not tied:
        specs.append(("lm_head.weight", (vocab, d), s_e, 0.0))
    return specs


def f32_to_bf16(x):
    """Round-to-nearest-even of f32 to bf16, as uint16 (no NaNs occur in our weights)."""
    u = x.view(np.uint32)
    bias = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + bias) >> 16).astype(np.uint16)


def tensor_chunks(seed, name, shape, std, mean, dtype):
    """The tensor's bytes in row blocks of about CHUNK_ELEMS values. The values depend only on
    (seed, name, shape): the same tensor is bit-identical across dtypes (before conversion),
    shard layouts and tying."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    rows = shape[0]
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, CHUNK_ELEMS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        x = rng.standard_normal(n * cols, dtype=np.float32)
        x *= np.float32(std)
        x += np.float32(mean)
        yield convert_f32(x, dtype)


def safetensors_header(entries, dtype, metadata):
    """The header bytes (length prefix included) of a safetensors file holding entries
    [(name, shape)] in order, all of dtype; and the data bytes they take. The JSON is padded with
    spaces so the data starts 8-aligned and every tensor is aligned to its element size."""
    st_name, esize, _ = DTYPES[dtype]
    header = {"__metadata__": metadata}
    off = 0
    for name, shape in entries:
        nbytes = int(np.prod(shape)) * esize
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-(8 + len(hb))) % 8)  # data starts 8-aligned: every tensor is aligned
    return struct.pack("<Q", len(hb)) + hb, off


def convert_f32(x, dtype):
    """f32 numpy values → the little-endian bytes of dtype (bf16: round to nearest even)."""
    if dtype == "f32":
        return x.astype("<f4", copy=False).tobytes()
    if dtype == "f16":
        return x.astype("<f2").tobytes()
    return f32_to_bf16(np.ascontiguousarray(x, dtype=np.float32)).astype("<u2",
                                                                          copy=False).tobytes()


def write_safetensors(path, specs, seed, dtype, metadata):
    """Streams one safetensors file tensor by tensor; returns its data bytes."""
    head, off = safetensors_header([(name, shape) for name, shape, _, _ in specs], dtype, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name, shape, std, mean in specs:
            for chunk in tensor_chunks(seed, name, shape, std, mean, dtype):
                f.write(chunk)
    return off


def write_safetensors_arrays(path, arrays, dtype, metadata):
    """Writes given tensors [(name, float32 numpy array)] (e.g. trained weights, see
    train_tiny.py) as one safetensors file in dtype; returns its data bytes."""
    head, off = safetensors_header([(name, a.shape) for name, a in arrays], dtype, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for _, a in arrays:
            f.write(convert_f32(a, dtype))
    return off


def split_shards(specs, n, esize):
    """n contiguous groups of tensors with about equal bytes, none empty."""
    if n > len(specs):
        sys.exit(f"gen_tiny_model: --shards {n} exceeds the {len(specs)} tensors")
    sizes = [int(np.prod(s[1])) * esize for s in specs]
    total = sum(sizes)
    groups, cur, acc = [], [], 0
    for i, (spec, size) in enumerate(zip(specs, sizes)):
        cur.append(spec)
        acc += size
        left_specs = len(specs) - i - 1
        left_groups = n - len(groups) - 1
        if left_groups > 0 and (acc >= total * (len(groups) + 1) / n or left_specs == left_groups):
            groups.append(cur)
            cur = []
    groups.append(cur)
    return groups


# ---- the directory -----------------------------------------------------------------------------

def config_json(p, vocab, tied, dtype, rope_style, bos, eos):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "hidden_size": p["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": p["ffn"],
        "max_position_embeddings": p["max_position"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": p["heads"],
        "num_hidden_layers": p["layers"],
        "num_key_value_heads": p["kv_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": p["rms_eps"],
    }
    rope = dict(p["rope"], rope_type="llama3")
    if rope_style == "parameters":  # transformers >= 4.56 / v5 spelling, "dtype" with it
        cfg["rope_parameters"] = dict(rope, rope_theta=p["rope_theta"])
        cfg["dtype"] = DTYPES[dtype][2]
    else:
        cfg["rope_scaling"] = rope if rope_style == "scaling" else None
        cfg["rope_theta"] = p["rope_theta"]
        cfg["torch_dtype"] = DTYPES[dtype][2]
    cfg.update({"tie_word_embeddings": tied, "transformers_version": "4.45.0",
                "use_cache": True, "vocab_size": vocab})
    return cfg


# Llama 3 Instruct's chat template (Jinja, as its tokenizer_config.json carries it), given to the
# llama3-style tokenizers so that the gateway's chat path runs a real template in tests; the
# gpt2-style models have none (the gateway then falls back to ChatML).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")


def tokenizer_config(tok, style, max_position):
    specials = [t for t in tok.get("added_tokens", []) if t.get("special")]
    bos, eos_names = special_names(tok)
    eos = eos_names[0]
    extra = {"chat_template": LLAMA3_CHAT_TEMPLATE} if style == "llama3" else {}
    return extra | {
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in (
            "content", "lstrip", "normalized", "rstrip", "single_word", "special") if k in t}
            for t in specials},
        "bos_token": bos,
        "clean_up_tokenization_spaces": style == "gpt2",
        "eos_token": eos,
        "model_max_length": max_position,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_model_files(tmp, p, vocab, tied, dtype, rope_style, tok, tok_style):
    """Everything of the directory except the weights: config.json, generation_config.json,
    tokenizer_config.json and tokenizer.json (also used by train_tiny.py)."""
    bos, eos = special_ids(tok)
    write_json(os.path.join(tmp, "config.json"),
               config_json(p, vocab, tied, dtype, rope_style, bos, eos))
    write_json(os.path.join(tmp, "generation_config.json"),
               {"bos_token_id": bos, "eos_token_id": eos, "do_sample": True,
                "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"})
    write_json(os.path.join(tmp, "tokenizer_config.json"),
               tokenizer_config(tok, tok_style, p["max_position"]))
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


def write_dir_atomically(out, fill):
    """Calls fill(tmp) on an empty DIR.tmp.<pid> next to out, then renames it into place (the
    old directory, if any, is removed after), so a reader never sees half a model. Returns what
    fill returns."""
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        result = fill(tmp)
        if os.path.exists(out):
            old = f"{out}.old.{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def generate(args, tmp):
    p = PRESETS[args.preset]
    tied = p["tied"] if args.tied is None else args.tied
    tok = make_tokenizer(args.tokenizer_style, args.tokenizer_vocab or p["tok_vocab"],
                         args.tokenizer_cache)
    tok_ids = tokenizer_size(tok)
    vocab = p.get("vocab_size", tok_ids)
    if vocab < tok_ids:
        sys.exit(f"gen_tiny_model: the tokenizer has {tok_ids} ids, more than vocab_size {vocab}")
    write_model_files(tmp, p, vocab, tied, args.dtype, args.rope_style, tok,
                      args.tokenizer_style)

    specs = tensor_specs(p, vocab, tied)
    meta = {"format": "pt", "generator": "pie-c tools/tinymodel/gen_tiny_model.py",
            "preset": args.preset, "seed": str(args.seed)}
    if args.shards <= 1:
        total = write_safetensors(os.path.join(tmp, "model.safetensors"), specs, args.seed,
                                  args.dtype, meta)
    else:
        groups = split_shards(specs, args.shards, DTYPES[args.dtype][1])
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            total += write_safetensors(os.path.join(tmp, fname), group, args.seed, args.dtype,
                                       meta)
            weight_map.update({name: fname for name, _, _, _ in group})
        write_json(os.path.join(tmp, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total},
                    "weight_map": dict(sorted(weight_map.items()))})
    return vocab, tok_ids, tied, total


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write a deterministic Llama model directory.")
    ap.add_argument("--out", required=True, help="model directory to (re)create")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--seed", type=int, default=0)
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None,
                     help="lm_head is the embedding (default for tiny and llama-3.2-1b)")
    tie.add_argument("--untied", dest="tied", action="store_false",
                     help="write lm_head.weight (default for small)")
    ap.add_argument("--shards", type=int, default=1,
                    help="split the weights over N files with model.safetensors.index.json")
    ap.add_argument("--rope-style", choices=["scaling", "parameters", "none"], default="scaling",
                    help="llama3 scaling as rope_scaling (default), as rope_parameters (with "
                         "rope_theta inside and 'dtype' for 'torch_dtype'), or rope_scaling: null")
    ap.add_argument("--tokenizer-style", choices=TOKENIZER_STYLES, default="llama3")
    ap.add_argument("--tokenizer-vocab", type=int, default=0,
                    help="ids the tokenizer is trained to (default: the preset's)")
    ap.add_argument("--tokenizer-cache", default="",
                    help="directory caching trained tokenizers by the hash of their inputs")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    global QUIET
    QUIET = args.quiet
    if args.seed < 0 or args.shards < 1:
        ap.error("--seed must be >= 0 and --shards >= 1")

    t0 = time.time()
    out = os.path.abspath(args.out)
    vocab, tok_ids, tied, total = write_dir_atomically(out, lambda tmp: generate(args, tmp))
    log(f"wrote {out}: preset {args.preset}, {args.dtype}, seed {args.seed}, "
        f"{'tied' if tied else 'untied'}, vocab {vocab} (tokenizer {tok_ids}), "
        f"{total / 1e6:.1f} MB in {args.shards} file(s), {time.time() - t0:.2f} s")


if __name__ == "__main__":
    main()
