#!/usr/bin/python3
"""hf_to_gguf.py — writes a GGUF v3 file (llama.cpp's format) from a Hugging Face Llama directory.

Owns: reading a Llama model directory (config.json, tokenizer.json, tokenizer_config.json and
model.safetensors or shards listed in model.safetensors.index.json), the GGUF writer (header,
metadata, tensor infos, aligned data; written from ggml's docs/gguf.md), the llama
architecture's metadata and tensor names, the tokenizer as llama.cpp's "gpt2" BPE model, and
the element-type conversion (f32 / bf16 / f16). Used by bench/peers/ to run llama.cpp on the
same weights as the engine; bench/peers/verify.mjs checks the result against the engine.

Layout differences from Hugging Face that the file must carry:
  * ggml lists dimensions fastest first, so an HF weight [out, in] is written with ne = [in, out]
    (the bytes are the same row-major matrix).
  * llama.cpp's rotary embedding (GGML_ROPE_TYPE_NORM for "llama") rotates adjacent pairs
    (2i, 2i+1) of a head, HF's rotate_half rotates (i, i + d/2). So the rows of q_proj and k_proj
    are reordered inside each head: new row 2i+j (j = 0, 1) is old row i + j*d/2. Q and K get
    the same reordering, so q·k (and so attention) is unchanged.
  * Llama-3 ("llama3") RoPE scaling is not metadata but a tensor "rope_freqs.weight" of head_dim/2
    f32 divisors of each rotary frequency: 1 for short wavelengths (< original context /
    high_freq_factor), `factor` for long ones (> original context / low_freq_factor), and in
    between 1 / ((1 - s)/factor + s) with s = (original context / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor) — the same frequencies HF's llama3 rope computes.
  * Norm weights and rope_freqs are always f32 (llama.cpp expects 1-D tensors in f32).
  * Tied embeddings: no output.weight (llama.cpp then uses token_embd for the LM head).
  * The vocabulary is padded to the model's vocab_size with "[PADn]" tokens of type UNUSED when
    the tokenizer has fewer ids than the embedding rows (the llama-3.2-1b preset: 4,101 ids,
    128,256 rows).

Usage: hf_to_gguf.py MODEL_DIR --out FILE.gguf [--outtype auto|f32|bf16|f16] [--quiet]
  --outtype auto (default) keeps the checkpoint's type. Debian's /usr/bin/python3 with numpy.
  The file is written next to FILE and renamed into place at the end.
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

# ---- GGUF constants (ggml docs/gguf.md) --------------------------------------------------------

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# metadata value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)

# ggml tensor types and the general.file_type ("mostly X") that goes with each
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FILE_TYPE = {GGML_F32: 0, GGML_F16: 1, GGML_BF16: 32}
OUTTYPES = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16}

# tokenizer.ggml.token_type values
TOK_NORMAL, TOK_CONTROL, TOK_USER_DEFINED, TOK_UNUSED = 1, 3, 4, 5


def log(msg, quiet=False):
    if not quiet:
        print(f"hf_to_gguf: {msg}", file=sys.stderr)


def fail(msg):
    print(f"hf_to_gguf: {msg}", file=sys.stderr)
    sys.exit(1)


# ---- metadata encoding -------------------------------------------------------------------------

def enc_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


SCALAR_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I",
              T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q",
              T_FLOAT64: "<d"}


def enc_value(vtype, value):
    if vtype == T_STRING:
        return enc_str(value)
    return struct.pack(SCALAR_FMT[vtype], value)


def enc_kv(key, vtype, value, elem_type=None):
    """One metadata pair: key, value type, value (arrays: element type, count, elements)."""
    out = [enc_str(key), struct.pack("<I", vtype)]
    if vtype == T_ARRAY:
        out.append(struct.pack("<IQ", elem_type, len(value)))
        if elem_type == T_STRING:
            out.extend(enc_str(v) for v in value)
        else:
            out.append(np.asarray(value, dtype=np.dtype(SCALAR_FMT[elem_type])).tobytes())
    else:
        out.append(enc_value(vtype, value))
    return b"".join(out)


# ---- safetensors reading -----------------------------------------------------------------------

ST_DTYPES = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16}


def open_safetensors(path):
    """{name: (dtype string, shape, numpy memmap of the raw elements)} of one file."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    base = 8 + hlen
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e["dtype"] not in ST_DTYPES:
            fail(f"{path}: tensor {name} has dtype {e['dtype']} (only F32, BF16, F16 are read)")
        lo, hi = e["data_offsets"]
        npt = ST_DTYPES[e["dtype"]]
        count = (hi - lo) // np.dtype(npt).itemsize
        arr = np.memmap(path, dtype=npt, mode="r", offset=base + lo, shape=(count,))
        out[name] = (e["dtype"], tuple(e["shape"]), arr.reshape(e["shape"]))
    return out


def load_tensors(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for fn in files:
        tensors.update(open_safetensors(os.path.join(model_dir, fn)))
    return tensors


# ---- element types -----------------------------------------------------------------------------

def to_f32(st_dtype, raw):
    if st_dtype == "F32":
        return np.asarray(raw, dtype=np.float32)
    if st_dtype == "F16":
        return np.asarray(raw, dtype=np.float32)
    return (np.asarray(raw, dtype=np.uint32) << 16).view(np.float32)  # BF16


def f32_to_bf16(x):
    """Round to nearest even (NaN kept as a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def convert(st_dtype, raw, gtype):
    """raw elements (safetensors dtype) → bytes of ggml type gtype; no round trip when equal."""
    if gtype == GGML_BF16 and st_dtype == "BF16":
        return np.ascontiguousarray(raw, dtype=np.uint16).tobytes()
    if gtype == GGML_F16 and st_dtype == "F16":
        return np.ascontiguousarray(raw, dtype=np.float16).tobytes()
    x = to_f32(st_dtype, raw)
    if gtype == GGML_F32:
        return np.ascontiguousarray(x).tobytes()
    if gtype == GGML_F16:
        return x.astype(np.float16).tobytes()
    return f32_to_bf16(x).tobytes()


ELT_BYTES = {GGML_F32: 4, GGML_F16: 2, GGML_BF16: 2}


# ---- the model ---------------------------------------------------------------------------------

def rope_params(cfg):
    """(theta, scaling dict or None) in either spelling (rope_scaling + rope_theta, or
    transformers >= 4.56's rope_parameters)."""
    rp = cfg.get("rope_parameters")
    if rp:
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rp if rp.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def llama3_rope_factors(theta, head_dim, s):
    """Divisors of each of the head_dim/2 rotary frequencies (see the module comment)."""
    factor = float(s.get("factor", 8.0))
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def permute_rope_rows(w, n_heads):
    """Rows of q_proj / k_proj [n_heads*d, in]: HF's half-split pairs → llama.cpp's adjacent pairs."""
    out_dim = w.shape[0]
    d = out_dim // n_heads
    return (np.asarray(w).reshape(n_heads, 2, d // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


HF_LAYER_NAMES = {  # HF suffix after "model.layers.N." → GGUF name after "blk.N."
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def plan_tensors(cfg, tensors, outtype):
    """[(gguf name, ggml type, ne list, producer() → bytes)] in the order they are written."""
    n_layers = cfg["num_hidden_layers"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                        cfg["num_attention_heads"])
    tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in tensors
    plan = []

    def add(hf_name, gg_name, permute_heads=0):
        if hf_name not in tensors:
            fail(f"the checkpoint has no tensor {hf_name}")
        st_dtype, shape, raw = tensors[hf_name]
        gtype = GGML_F32 if len(shape) == 1 else (outtype if outtype is not None
                                                  else {"F32": GGML_F32, "BF16": GGML_BF16,
                                                        "F16": GGML_F16}[st_dtype])

        def produce():
            w = permute_rope_rows(raw, permute_heads) if permute_heads else raw
            return convert(st_dtype, w, gtype)

        plan.append((gg_name, gtype, list(reversed(shape)), produce))

    add("model.embed_tokens.weight", "token_embd.weight")
    for i in range(n_layers):
        for hf, gg in HF_LAYER_NAMES.items():
            heads = n_heads if hf.startswith("self_attn.q_") else (
                n_kv if hf.startswith("self_attn.k_") else 0)
            add(f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", heads)
    add("model.norm.weight", "output_norm.weight")
    if not tied:
        add("lm_head.weight", "output.weight")

    theta, scaling = rope_params(cfg)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        f = llama3_rope_factors(theta, head_dim, scaling)
        plan.append(("rope_freqs.weight", GGML_F32, [len(f)], lambda f=f: f.tobytes()))
    elif scaling:
        fail(f"config.json: rope scaling type {scaling.get('rope_type')!r} is not supported "
             "(only llama3)")
    return plan, tied


def arch_metadata(cfg, outtype_file, name):
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    theta, _ = rope_params(cfg)
    kv = [
        enc_kv("general.architecture", T_STRING, "llama"),
        enc_kv("general.name", T_STRING, name),
        enc_kv("general.file_type", T_UINT32, outtype_file),
        enc_kv("general.alignment", T_UINT32, ALIGNMENT),
        enc_kv("llama.context_length", T_UINT32, cfg.get("max_position_embeddings", 2048)),
        enc_kv("llama.embedding_length", T_UINT32, cfg["hidden_size"]),
        enc_kv("llama.block_count", T_UINT32, cfg["num_hidden_layers"]),
        enc_kv("llama.feed_forward_length", T_UINT32, cfg["intermediate_size"]),
        enc_kv("llama.attention.head_count", T_UINT32, n_heads),
        enc_kv("llama.attention.head_count_kv", T_UINT32,
               cfg.get("num_key_value_heads", n_heads)),
        enc_kv("llama.rope.freq_base", T_FLOAT32, theta),
        enc_kv("llama.rope.dimension_count", T_UINT32, head_dim),
        enc_kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, cfg.get("rms_norm_eps", 1e-5)),
        enc_kv("llama.vocab_size", T_UINT32, cfg["vocab_size"]),
    ]
    if head_dim != cfg["hidden_size"] // n_heads:
        kv += [enc_kv("llama.attention.key_length", T_UINT32, head_dim),
               enc_kv("llama.attention.value_length", T_UINT32, head_dim)]
    return kv


# ---- the tokenizer -----------------------------------------------------------------------------

def pre_tokenizer_name(tok):
    """llama.cpp's name for the pre-tokenizer: "llama-bpe" for Llama 3's Split regex before
    ByteLevel, "gpt-2" for a bare ByteLevel (GPT-2's built-in regex; llama.cpp spells it with a hyphen)."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        kinds = [p.get("type") for p in pre.get("pretokenizers", [])]
        if kinds and kinds[0] == "Split" and "ByteLevel" in kinds:
            return "llama-bpe"
    fail(f"tokenizer.json: pre_tokenizer {json.dumps(pre)[:120]} is neither Llama 3's nor "
         "GPT-2's; pass --pre")


def add_bos_of(tok, tok_cfg, bos):
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    post = tok.get("post_processor") or {}
    posts = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in posts:
        if p.get("type") == "TemplateProcessing":
            first = (p.get("single") or [{}])[0]
            return "SpecialToken" in first and first["SpecialToken"].get("id") == bos
    return False


def tokenizer_metadata(model_dir, cfg, pre_override):
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    tok_cfg = {}
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            tok_cfg = json.load(f)
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        fail(f"tokenizer.json: model type {model.get('type')!r} (only BPE is converted)")

    n_vocab = cfg["vocab_size"]
    tokens = [None] * n_vocab
    types = [TOK_UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        if i >= n_vocab:
            fail(f"tokenizer.json: token {text!r} has id {i} >= vocab_size {n_vocab}")
        tokens[i], types[i] = text, TOK_NORMAL
    for a in tok.get("added_tokens", []):
        i = a["id"]
        if i >= n_vocab:
            fail(f"tokenizer.json: added token {a['content']!r} has id {i} >= vocab_size {n_vocab}")
        tokens[i] = a["content"]
        types[i] = TOK_CONTROL if a.get("special") else TOK_USER_DEFINED
    n_pad = 0
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i], n_pad = f"[PAD{i}]", n_pad + 1

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def id_of(v):
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            hits = [a["id"] for a in tok.get("added_tokens", []) if a["content"] == v]
            return hits[0] if hits else model["vocab"].get(v)
        return v

    bos = cfg.get("bos_token_id")
    if bos is None:
        bos = id_of(tok_cfg.get("bos_token"))
    eos = cfg.get("eos_token_id")
    eos = id_of(eos) if isinstance(eos, list) else eos
    if eos is None:
        eos = id_of(tok_cfg.get("eos_token"))

    kv = [
        enc_kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        enc_kv("tokenizer.ggml.pre", T_STRING, pre_override or pre_tokenizer_name(tok)),
        enc_kv("tokenizer.ggml.tokens", T_ARRAY, tokens, T_STRING),
        enc_kv("tokenizer.ggml.token_type", T_ARRAY, types, T_INT32),
        enc_kv("tokenizer.ggml.merges", T_ARRAY, merges, T_STRING),
    ]
    bos_name = tokens[bos] if bos is not None else None
    if bos is not None:
        kv.append(enc_kv("tokenizer.ggml.bos_token_id", T_UINT32, bos))
    if eos is not None:
        kv.append(enc_kv("tokenizer.ggml.eos_token_id", T_UINT32, eos))
    kv.append(enc_kv("tokenizer.ggml.add_bos_token", T_BOOL, add_bos_of(tok, tok_cfg, bos_name)))
    if tok_cfg.get("chat_template"):
        kv.append(enc_kv("tokenizer.chat_template", T_STRING, tok_cfg["chat_template"]))
    return kv, n_pad


# ---- the file ----------------------------------------------------------------------------------

def pad_to(n, a=ALIGNMENT):
    return (n + a - 1) // a * a


def write_gguf(path, kvs, plan, quiet):
    infos, offset = [], 0
    for name, gtype, ne, _ in plan:
        nbytes = ELT_BYTES[gtype] * int(np.prod(ne))
        infos.append(enc_str(name) + struct.pack("<I", len(ne)) +
                     struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", gtype, offset))
        offset = pad_to(offset + nbytes)
    header = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(plan), len(kvs))
    head = header + b"".join(kvs) + b"".join(infos)
    tmp = path + ".tmp"
    t0 = time.time()
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(b"\0" * (pad_to(len(head)) - len(head)))
        for (name, gtype, ne, produce) in plan:
            data = produce()
            if len(data) != ELT_BYTES[gtype] * int(np.prod(ne)):
                fail(f"internal: tensor {name} produced {len(data)} bytes")
            f.write(data)
            f.write(b"\0" * (pad_to(len(data)) - len(data)))
    os.replace(tmp, path)
    log(f"wrote {path}: {len(plan)} tensors, {os.path.getsize(path) / 1e6:.1f} MB in "
        f"{time.time() - t0:.1f} s", quiet)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--outtype", choices=["auto", *OUTTYPES], default="auto")
    ap.add_argument("--pre", help="tokenizer.ggml.pre (default: from tokenizer.json)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()

    with open(os.path.join(a.model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        fail(f"config.json: model_type {cfg.get('model_type')!r} (only llama is converted)")
    tensors = load_tensors(a.model_dir)
    outtype = None if a.outtype == "auto" else OUTTYPES[a.outtype]
    plan, tied = plan_tensors(cfg, tensors, outtype)
    main_type = plan[0][1]  # token_embd's type names the file's
    kvs = arch_metadata(cfg, FILE_TYPE[main_type], os.path.basename(os.path.abspath(a.model_dir)))
    tkv, n_pad = tokenizer_metadata(a.model_dir, cfg, a.pre)
    kvs += tkv
    log(f"{a.model_dir}: {cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']} "
        f"({n_pad} padding tokens), {'tied' if tied else 'untied'} embeddings", a.quiet)
    write_gguf(a.out, kvs, plan, a.quiet)


if __name__ == "__main__":
    main()
