"""ref_llama.py — an independent reference Llama, the oracle for the engine's forward pass.

Owns: (1) a Llama decoder written from the Hugging Face LlamaForCausalLM definition (RMSNorm,
RoPE in the rotate_half convention with Llama-3 frequency scaling as transformers'
_compute_llama3_parameters, GQA by repeating KV heads, SwiGLU MLP, tied or untied lm_head),
computed in float64 from the stored weights; (2) a model of the engine's paged-KV contract
(services/worker/engine/eng.h) at the level of sequences: KV pages with per-token masks,
embedding slots with positions, ragged forward batches with RLE attention masks, page copies,
logits and next-token distributions.
Does not own: anything of the C code. Nothing here was derived from it; where eng.h leaves a
case open the reference documents its choice (README.md, "Batch semantics").

Dependencies are what Debian ships: python3-torch and python3-numpy. safetensors files are
parsed here (8-byte little-endian header length, JSON header, raw data)."""

import json
import math
import os
import struct

import numpy as np
import torch

DTYPE = torch.float64  # every activation and weight of the reference

# ----------------------------------------------------------------------------------------------
# safetensors

_ST_ELT = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_ST_NAME = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}


def _decode_tensor(dtype, raw, shape):
    """Raw little-endian bytes → float32/float64 numpy array of shape (exact conversion)."""
    if dtype == "F32":
        a = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F64":
        a = np.frombuffer(raw, dtype="<f8")
    elif dtype == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        # bf16 is the top half of an IEEE float32: widen the bits, shift, reinterpret.
        a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"unsupported safetensors dtype {dtype}")
    return a.reshape(shape)


def read_safetensors(path):
    """{name: (numpy array, dtype string "f32"/"f16"/"bf16")} of every tensor in one file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if 8 + hlen > len(blob):
        raise ValueError(f"{path}: header length {hlen} exceeds the file size {len(blob)}")
    header = json.loads(blob[8:8 + hlen].decode("utf-8"))
    data = memoryview(blob)[8 + hlen:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = meta["dtype"], list(meta["shape"])
        begin, end = meta["data_offsets"]
        if dtype not in _ST_ELT:
            raise ValueError(f"{path}: tensor {name!r}: unsupported dtype {dtype}")
        want = _ST_ELT[dtype] * int(np.prod(shape, dtype=np.int64))
        if end - begin != want or end > len(data):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}) do not "
                             f"hold {want} bytes of {dtype}{shape}")
        out[name] = (_decode_tensor(dtype, data[begin:end], shape), _ST_NAME[dtype])
    return out


def read_model_tensors(model_dir):
    """Every tensor of an HF model dir: model.safetensors, or the shards its index names."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for shard in sorted(set(weight_map.values())):
            tensors = read_safetensors(os.path.join(model_dir, shard))
            for name, where in weight_map.items():
                if where == shard:
                    if name not in tensors:
                        raise ValueError(f"{model_dir}: index puts {name!r} in {shard}, "
                                         f"which lacks it")
                    out[name] = tensors[name]
        return out
    return read_safetensors(os.path.join(model_dir, "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# config and RoPE


class LlamaConfig:
    """The fields of config.json the decoder needs, with LlamaConfig's defaults."""

    def __init__(self, d):
        self.raw = d
        self.vocab_size = int(d["vocab_size"])
        self.hidden_size = int(d["hidden_size"])
        self.intermediate_size = int(d["intermediate_size"])
        self.n_layers = int(d["num_hidden_layers"])
        self.n_heads = int(d["num_attention_heads"])
        self.n_kv_heads = int(d.get("num_key_value_heads") or self.n_heads)
        self.head_dim = int(d.get("head_dim") or self.hidden_size // self.n_heads)
        self.max_position = int(d.get("max_position_embeddings", 2048))
        self.rms_eps = float(d.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d.get('hidden_act')!r}: only silu is Llama")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias/mlp_bias: biases are not part of the tested models")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_key_value_heads {self.n_kv_heads} does not divide "
                             f"num_attention_heads {self.n_heads}")
        # RoPE: the older "rope_scaling" dict beside a top-level rope_theta, or the newer
        # "rope_parameters" dict that carries rope_theta itself.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        self.rope_source = ("rope_parameters" if d.get("rope_parameters") else
                            "rope_scaling" if d.get("rope_scaling") else "none")
        self.rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        self.rope_type = rope.get("rope_type", rope.get("type", "default"))
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type {self.rope_type!r}: the reference knows default, llama3")
        self.rope_scaling = dict(rope) if self.rope_type == "llama3" else None

    @classmethod
    def from_dir(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls(json.load(f))


def rope_inv_freq(cfg):
    """inv_freq [head_dim/2], float64: base^(-2i/d), then Llama-3 scaling when configured —
    the same arithmetic as transformers' _compute_default_rope_parameters and
    _compute_llama3_parameters (vectorised form, torch.where over three bands)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=DTYPE) / d))
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, positions, inv_freq):
    """x [n, heads, head_dim] rotated at positions [n] (HF: x*cos + rotate_half(x)*sin with
    cos/sin of cat(freqs, freqs))."""
    freqs = torch.as_tensor(positions, dtype=DTYPE)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------
# the model


class LlamaModel:
    """Weights (float64) and the per-layer math. Layer weights are HF Linear weights [out, in]."""

    def __init__(self, cfg, tensors, dtype="f32"):
        self.cfg = cfg
        self.dtype = dtype  # weights as stored
        t = lambda name: torch.tensor(np.array(tensors[name]), dtype=DTYPE)
        self.embed = t("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "attn_norm": t(p + "input_layernorm.weight"),
                "wq": t(p + "self_attn.q_proj.weight"),
                "wk": t(p + "self_attn.k_proj.weight"),
                "wv": t(p + "self_attn.v_proj.weight"),
                "wo": t(p + "self_attn.o_proj.weight"),
                "ffn_norm": t(p + "post_attention_layernorm.weight"),
                "w_gate": t(p + "mlp.gate_proj.weight"),
                "w_up": t(p + "mlp.up_proj.weight"),
                "w_down": t(p + "mlp.down_proj.weight"),
            })
        self.norm = t("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else t("lm_head.weight")
        self.inv_freq = rope_inv_freq(cfg)
        self._check_shapes()

    def _check_shapes(self):
        c = self.cfg
        d, f, q, kv = c.hidden_size, c.intermediate_size, c.n_heads * c.head_dim, \
            c.n_kv_heads * c.head_dim
        want = {"attn_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q),
                "ffn_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
        for i, layer in enumerate(self.layers):
            for k, shape in want.items():
                if tuple(layer[k].shape) != shape:
                    raise ValueError(f"layer {i} {k}: shape {tuple(layer[k].shape)}, "
                                     f"expected {shape}")
        for name, w in (("embed", self.embed), ("lm_head", self.lm_head)):
            if tuple(w.shape) != (c.vocab_size, d):
                raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {(c.vocab_size, d)}")

    @classmethod
    def from_dir(cls, model_dir):
        cfg = LlamaConfig.from_dir(model_dir)
        raw = read_model_tensors(model_dir)
        dtypes = {dt for _, dt in raw.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"
        return cls(cfg, {name: a for name, (a, _) in raw.items()}, dtype)

    def rms_norm(self, x, w):
        return w * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.cfg.rms_eps))

    def qkv(self, layer, x, positions):
        """x [n, d] (the residual stream) → rotated q [n, H, hd], rotated k and v [n, KVH, hd]."""
        c, w = self.cfg, self.layers[layer]
        xn = self.rms_norm(x, w["attn_norm"])
        n = x.shape[0]
        q = (xn @ w["wq"].T).reshape(n, c.n_heads, c.head_dim)
        k = (xn @ w["wk"].T).reshape(n, c.n_kv_heads, c.head_dim)
        v = (xn @ w["wv"].T).reshape(n, c.n_kv_heads, c.head_dim)
        return apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq), v

    def attend(self, q, keys, values, visible):
        """q [n, H, hd]; keys/values [m, KVH, hd]; visible [n, m] bool → [n, H*hd].
        GQA: query head h reads kv head h // (H/KVH) (HF repeat_kv)."""
        c = self.cfg
        rep = c.n_heads // c.n_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, keys) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~visible[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hij,jhd->ihd", probs, values).reshape(q.shape[0], -1)

    def finish_layer(self, layer, x, attn_out):
        """Residual after attention, then the SwiGLU MLP block with its residual."""
        w = self.layers[layer]
        h = x + attn_out @ w["wo"].T
        hn = self.rms_norm(h, w["ffn_norm"])
        mlp = (torch.nn.functional.silu(hn @ w["w_gate"].T) * (hn @ w["w_up"].T)) @ w["w_down"].T
        return h + mlp

    def logits_of(self, hidden):
        """hidden [..., d] already through the final norm → logits [..., vocab]."""
        return hidden @ self.lm_head.T

    def dense_logits(self, tokens, positions=None):
        """Plain causal forward of one sequence with no cache: logits [n, vocab]. Used to check
        the paged model below against the textbook form."""
        n = len(tokens)
        positions = list(range(n)) if positions is None else positions
        x = self.embed[torch.as_tensor(tokens)]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for layer in range(self.cfg.n_layers):
            q, k, v = self.qkv(layer, x, positions)
            x = self.finish_layer(layer, x, self.attend(q, k, v, causal))
        return self.logits_of(self.rms_norm(x, self.norm))


# ----------------------------------------------------------------------------------------------
# the engine contract over pages and slots


class InvalidArgument(ValueError):
    """An input the engine must refuse with INVALID_ARGUMENT (pie_code 3)."""


def mask_rows(runs, n_context, n_in):
    """pie.v1.AttentionMask runs → visible [n_in, n_context + n_in] bool (False beyond a row's
    C + i + 1 tokens). Raises InvalidArgument as common.proto specifies."""
    vis = torch.zeros(n_in, n_context + n_in, dtype=torch.bool)
    idx = 0
    for i in range(n_in):
        length, filled, visible = n_context + i + 1, 0, True
        while filled < length:
            if idx >= len(runs):
                raise InvalidArgument(f"mask: runs end inside row {i}")
            r = int(runs[idx])
            idx += 1
            if r < 0 or filled + r > length:
                raise InvalidArgument(f"mask: run {idx - 1} ({r}) crosses the end of row {i} "
                                      f"({length} tokens)")
            vis[i, filled:filled + r] = visible
            filled += r
            visible = not visible
        if not vis[i, length - 1]:
            raise InvalidArgument(f"mask: row {i} masks the input itself")
    if idx != len(runs):
        raise InvalidArgument(f"mask: {len(runs) - idx} runs left over after row {n_in - 1}")
    return vis


def runs_from_rows(rows):
    """Inverse of mask_rows: rows is a list of bool lists (row i has C + i + 1 entries)."""
    runs = []
    for row in rows:
        cur, count = True, 0
        for b in row:
            if bool(b) == cur:
                count += 1
            else:
                runs.append(count)
                cur, count = bool(b), 1
        runs.append(count)
    return runs


class PagedReference:
    """The engine's state and handlers (eng.h) at the level of sequences.

    KV pool: k/v [layers, pages, page_size, n_kv_heads, head_dim] holding ROTATED keys (a page
    does not know positions; a token's K carries the RoPE of the position it was computed at,
    so copies keep it). page_masked [pages, page_size]. Embedding slots: hidden [slots, d] and
    position [slots]. `written`/`slot_set` record what was ever stored so that a test script
    reading garbage is caught here rather than compared."""

    def __init__(self, model, page_size=16, n_pages=64, n_slots=256, kv_bf16=False):
        """kv_bf16: model an engine whose KV pool stores bf16 (eng_opts.kv_dtype): every K/V
        value a forward computes is rounded to bf16 (nearest even, through f32 as the engine
        does) before it is stored or attended to."""
        c = model.cfg
        self.model, self.page_size, self.n_pages, self.n_slots = model, page_size, n_pages, n_slots
        self.kv_bf16 = kv_bf16
        shape = (c.n_layers, n_pages, page_size, c.n_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=DTYPE)
        self.v = torch.zeros(shape, dtype=DTYPE)
        self.page_masked = torch.zeros(n_pages, page_size, dtype=torch.bool)
        self.written = torch.zeros(n_pages, page_size, dtype=torch.bool)
        self.hidden = torch.zeros(n_slots, c.hidden_size, dtype=DTYPE)
        self.position = [0] * n_slots
        self.slot_set = [False] * n_slots

    # -- validation helpers
    def _slot(self, s, what):
        if not 0 <= s < self.n_slots:
            raise InvalidArgument(f"{what}: slot {s} is out of range [0, {self.n_slots})")
        return s

    def _page(self, p, what):
        if not 0 <= p < self.n_pages:
            raise InvalidArgument(f"{what}: kv page {p} is out of range [0, {self.n_pages})")
        return p

    # -- handlers
    def embed(self, slots, tokens, positions):
        if not len(slots) == len(tokens) == len(positions):
            raise InvalidArgument("embed: slots, tokens and positions differ in length")
        for s, t in zip(slots, tokens):
            self._slot(s, "embed")
            if not 0 <= t < self.model.cfg.vocab_size:
                raise InvalidArgument(f"embed: token {t} is out of range")
        for s, t, p in zip(slots, tokens, positions):
            self.hidden[s] = self.model.embed[t]
            self.position[s] = int(p)
            self.slot_set[s] = True

    def _plan(self, i, item):
        """Validates one forward item; returns its geometry."""
        what = f"forward: item {i}"
        pages = [self._page(p, what) for p in item["kv_pages"]]
        last = int(item["kv_last_page_len"])
        in_slots = [self._slot(s, what) for s in item["in_slots"]]
        out_slots = [self._slot(s, what) for s in item["out_slots"]]
        append = bool(item["append_kv"])
        if pages and not 1 <= last <= self.page_size:
            raise InvalidArgument(f"{what}: kv_last_page_len {last} is out of range "
                                  f"[1, {self.page_size}]")
        if not pages and last != 0:
            raise InvalidArgument(f"{what}: kv_last_page_len {last} with no pages")
        if not in_slots:
            raise InvalidArgument(f"{what}: no inputs")
        if len(out_slots) > len(in_slots):
            raise InvalidArgument(f"{what}: {len(out_slots)} outputs for {len(in_slots)} inputs")
        total = (len(pages) - 1) * self.page_size + last if pages else 0
        n_ctx = total - len(in_slots) if append else total
        if n_ctx < 0:
            raise InvalidArgument(f"{what}: {len(in_slots)} appended inputs exceed the "
                                  f"{total} tokens of the pages")
        if "mask_runs" in item and item["mask_runs"] is not None:
            vis = mask_rows(item["mask_runs"], n_ctx, len(in_slots))
        else:
            vis = torch.ones(len(in_slots), n_ctx + len(in_slots), dtype=torch.bool).tril(n_ctx)
        where = [(pages[t // self.page_size], t % self.page_size) for t in range(total)]
        return dict(pages=pages, in_slots=in_slots, out_slots=out_slots, append=append,
                    n_ctx=n_ctx, vis=vis, ctx=where[:n_ctx], dest=where[n_ctx:])

    def forward(self, items):
        """eng_forward, as pie.v1.ForwardBatch: per layer every appending item's new K/V is
        written to the pages before any item attends, so an item may read positions another
        item of the batch appends. Refused: two items writing the same page position, an item
        whose input slot is another item's output slot. Nothing changes when anything is
        refused."""
        plans = [self._plan(i, it) for i, it in enumerate(items)]
        writer, out_of = {}, {}
        for i, p in enumerate(plans):
            for s in p["out_slots"]:
                out_of.setdefault(s, i)
            if p["append"]:
                for pos in p["dest"]:
                    if pos in writer:
                        raise InvalidArgument(f"forward: items {writer[pos]} and {i} both write "
                                              f"kv page {pos[0]} token {pos[1]}")
                    writer[pos] = i
        for i, p in enumerate(plans):
            for s in p["in_slots"]:
                if out_of.get(s, i) != i:
                    raise InvalidArgument(f"forward: item {i}: input slot {s} is an output "
                                          f"slot of item {out_of[s]}")
        for i, p in enumerate(plans):
            for s in p["in_slots"]:
                if not self.slot_set[s]:
                    raise AssertionError(f"test script: forward item {i} reads slot {s}, "
                                         f"never written")
            for pos in p["ctx"]:
                if not self.written[pos] and pos not in writer:
                    raise AssertionError(f"test script: forward item {i} reads page {pos[0]} "
                                         f"token {pos[1]}, never written")
        m = self.model
        xs = [self.hidden[p["in_slots"]].clone() for p in plans]
        positions = [[self.position[s] for s in p["in_slots"]] for p in plans]
        ctx_idx, vis = [], []
        for p in plans:
            pg = torch.as_tensor([a for a, _ in p["ctx"]], dtype=torch.long)
            off = torch.as_tensor([b for _, b in p["ctx"]], dtype=torch.long)
            v = p["vis"].clone()
            v[:, :p["n_ctx"]] &= ~self.page_masked[pg, off][None, :]
            ctx_idx.append((pg, off))
            vis.append(v)
        for layer in range(m.cfg.n_layers):
            qkv = [m.qkv(layer, x, pos) for x, pos in zip(xs, positions)]
            if self.kv_bf16:
                rnd = lambda t: t.to(torch.float32).to(torch.bfloat16).to(DTYPE)  # noqa: E731
                qkv = [(q, rnd(k), rnd(v)) for q, k, v in qkv]
            for p, (_, k, v) in zip(plans, qkv):
                if p["append"]:
                    for j, (pg_, off_) in enumerate(p["dest"]):
                        self.k[layer, pg_, off_] = k[j]
                        self.v[layer, pg_, off_] = v[j]
            for i, (q, k, v) in enumerate(qkv):
                pg, off = ctx_idx[i]
                keys = torch.cat((self.k[layer, pg, off], k))
                values = torch.cat((self.v[layer, pg, off], v))
                xs[i] = m.finish_layer(layer, xs[i], m.attend(q, keys, values, vis[i]))
        for p in plans:
            for pos in (p["dest"] if p["append"] else []):
                self.written[pos] = True
        outs = []
        for p, x, pos in zip(plans, xs, positions):
            n_out = len(p["out_slots"])
            outs.append((m.rms_norm(x[len(x) - n_out:], m.norm), pos[len(pos) - n_out:]))
        for p, (out, out_pos) in zip(plans, outs):
            for j, s in enumerate(p["out_slots"]):
                self.hidden[s] = out[j]
                self.position[s] = out_pos[j]
                self.slot_set[s] = True

    def mask_page(self, page, masked):
        self._page(page, "mask_page")
        if len(masked) != self.page_size:
            raise InvalidArgument(f"mask_page: {len(masked)} entries, page size {self.page_size}")
        self.page_masked[page] = torch.as_tensor([bool(b) for b in masked])

    def copy_pages(self, items):
        """Copies applied in order; all validated first."""
        ps = self.page_size
        for i, c in enumerate(items):
            what = f"copy_pages: item {i}"
            self._page(c["src"], what)
            self._page(c["dst"], what)
            n = c["count"]
            if n < 1 or c["src_off"] + n > ps or c["dst_off"] + n > ps:
                raise InvalidArgument(f"{what}: {n} tokens from offsets {c['src_off']}/"
                                      f"{c['dst_off']} do not fit a page of {ps}")
            if c["src"] == c["dst"] and abs(c["src_off"] - c["dst_off"]) < n:
                raise InvalidArgument(f"{what}: overlapping ranges within page {c['src']}")
        for c in items:
            s = slice(c["src_off"], c["src_off"] + c["count"])
            d = slice(c["dst_off"], c["dst_off"] + c["count"])
            self.k[:, c["dst"], d] = self.k[:, c["src"], s].clone()
            self.v[:, c["dst"], d] = self.v[:, c["src"], s].clone()
            self.page_masked[c["dst"], d] = self.page_masked[c["src"], s].clone()
            self.written[c["dst"], d] = self.written[c["src"], s].clone()

    def logits(self, slot):
        self._slot(slot, "logits")
        if not self.slot_set[slot]:
            raise AssertionError(f"test script: logits of slot {slot}, never written")
        return self.model.logits_of(self.hidden[slot])

    def next_dist(self, slot, top_k, temperature):
        """Top-k ids (descending probability, ties → lower id) and their probabilities under
        softmax(logits / temperature) over the whole vocabulary."""
        if not 1 <= top_k <= self.model.cfg.vocab_size:
            raise InvalidArgument(f"next_dist: top_k {top_k} is out of range")
        if not temperature > 0:
            raise InvalidArgument(f"next_dist: temperature {temperature} is not positive")
        probs = torch.softmax(self.logits(slot) / temperature, dim=-1)
        order = np.argsort(-probs.numpy(), kind="stable")[:top_k]
        return [int(i) for i in order], [float(probs[i]) for i in order]

    def greedy(self, tokens, steps, pages, slot_base):
        """pie-engine-probe's greedy op over this state: prefill at positions 0..P-1 appending
        into pages, then steps argmax decodes (ties → lowest id). Returns (generated ids,
        margins) where margins[j] is the gap between the best and second-best logit at step j."""
        n = len(tokens)
        slots = list(range(slot_base, slot_base + n))
        self.embed(slots, tokens, list(range(n)))
        total = n
        out_slot = slots[-1]
        self.forward([dict(kv_pages=pages[:(total + self.page_size - 1) // self.page_size],
                           kv_last_page_len=(total - 1) % self.page_size + 1, append_kv=True,
                           in_slots=slots, out_slots=[out_slot])])
        generated, margins = [], []
        for step in range(steps):
            lg = self.logits(out_slot)
            top2 = torch.topk(lg, 2).values
            tok = int(torch.argmax(lg))  # first maximal index = lowest id
            generated.append(tok)
            margins.append(float(top2[0] - top2[1]))
            if step == steps - 1:
                break
            self.embed([slot_base], [tok], [total])
            total += 1
            self.forward([dict(kv_pages=pages[:(total + self.page_size - 1) // self.page_size],
                               kv_last_page_len=(total - 1) % self.page_size + 1,
                               append_kv=True, in_slots=[slot_base], out_slots=[out_slot])])
        return generated, margins


def meta_llama3_inv_freq(cfg):
    """Llama-3 RoPE scaling written the way Meta's reference code writes it (a scalar loop with
    if/elif/else), used to cross-check rope_inv_freq's vectorised transformers form."""
    d, s = cfg.head_dim, cfg.rope_scaling
    freqs = [1.0 / (cfg.rope_theta ** (i / d)) for i in range(0, d, 2)]
    if s is None:
        return freqs
    scale, low, high, old = (float(s["factor"]), float(s["low_freq_factor"]),
                             float(s["high_freq_factor"]),
                             float(s["original_max_position_embeddings"]))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / scale)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / scale + smooth * f)
    return out
