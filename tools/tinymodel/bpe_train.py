#!/usr/bin/python3
"""bpe_train.py — a small deterministic byte-level BPE trainer that writes a Hugging Face
tokenizer.json, for the tiny test models and the tokenizer's tests and benchmark.

Owns: pre-tokenizing a corpus the way the exported regex does (a hand-written scanner using
unicodedata, because the `regex` module is not available and `re` has no \\p{L}), counting byte
pairs, choosing merges (highest count; ties broken by the smaller pair of token byte strings),
and writing the JSON in two styles:

  llama3  pre_tokenizer Sequence[Split(Llama-3 regex, Isolated), ByteLevel(use_regex=false)],
          model BPE with ignore_merges=true, merges as ["a", "b"] pairs
  gpt2    pre_tokenizer ByteLevel(use_regex=true) (GPT-2's built-in regex), merges as "a b"
          strings, no ignore_merges

Both: ids 0..255 are the 256 byte tokens (in GPT-2's byte-level order: '!'..'~', then the other
printable Latin-1 bytes, then the remapped ones), then one id per merge, then the added special
tokens <|begin_of_text|>, <|end_of_text|>, <|eot_id|>, <|start_header_id|>, <|end_header_id|>.
`vocab_size` counts all of them, so the ids are exactly 0 .. vocab_size-1.

Also `encode(tok_json, text)`: a slow reference encoder over the same dict (used by the C tests
to cross-check services/common/tok).

Library use (tools/tinymodel/gen_tiny_model.py):
    import bpe_train
    tj = bpe_train.train_bpe(text, 512)                  # Llama-3 style dict
    tj = bpe_train.train_bpe(text, 512, style="gpt2")

Command line:
    bpe_train.py --corpus tools/tinymodel/corpus.txt --vocab-size 512 --style llama3 \\
                 --out tokenizer.json [--encode FILE --ids-out IDS]
Standard library only; runs with Debian's /usr/bin/python3.
"""

import argparse
import heapq
import json
import sys
import unicodedata

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>"]


def _byte_order():
    """GPT-2's byte -> code point table, and the byte order of ids 0..255."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) +
                 list(range(0xAE, 0xFF + 1)))
    to_cp = {b: b for b in printable}
    order = list(printable)
    n = 0
    for b in range(256):
        if b not in to_cp:
            to_cp[b] = 256 + n
            order.append(b)
            n += 1
    return [chr(to_cp[b]) for b in range(256)], order


BYTE_TO_CHAR, BYTE_ORDER = _byte_order()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def to_bytelevel(bs: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in bs)


def from_bytelevel(s: str) -> bytes:
    if all(c in CHAR_TO_BYTE for c in s):
        return bytes(CHAR_TO_BYTE[c] for c in s)
    return s.encode("utf-8")


# ---- pre-tokenization: the two regexes, written out as scanners ----

def _is_l(c):
    return unicodedata.category(c)[0] == "L"


def _is_n(c):
    return unicodedata.category(c)[0] == "N"


def _is_s(c):
    # Unicode's White_Space, as pie_tok spells \s out (services/common/tok/tok_regex.c): the ASCII
    # spaces, NEL and the separators (Z). Not U+180E, which PCRE2's own \s would add.
    return c in "\t\n\v\f\r \x85" or unicodedata.category(c) in ("Zs", "Zl", "Zp")


def _run(text, i, pred):
    j = i
    while j < len(text) and pred(text[j]):
        j += 1
    return j


def _contraction(text, i, caseless):
    if text[i] != "'":
        return 0
    nxt = text[i + 1:i + 3]
    low = nxt.lower() if caseless else nxt
    if low[:2] in ("re", "ve", "ll"):
        return 3
    if low[:1] in ("s", "t", "m", "d"):
        return 2
    return 0


def _space_alternatives(text, i):
    """The three whitespace alternatives shared by both patterns; 0 if text[i] is not space."""
    k = _run(text, i, _is_s)
    if k == i:
        return 0
    return k - i if k == len(text) or k - 1 == i else k - 1 - i


def _match_llama3(text, i):
    """Length of the Llama-3 pattern's match at i (always > 0 for a non-empty rest)."""
    n = _contraction(text, i, caseless=True)
    if n:
        return n
    c = text[i]
    # [^\r\n\p{L}\p{N}]?\p{L}+
    if c not in "\r\n" and not _is_l(c) and not _is_n(c) and i + 1 < len(text) and _is_l(text[i + 1]):
        return _run(text, i + 1, _is_l) - i
    if _is_l(c):
        return _run(text, i, _is_l) - i
    # \p{N}{1,3}
    if _is_n(c):
        return min(_run(text, i, _is_n) - i, 3)
    # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    j = i + 1 if c == " " else i
    punct = lambda x: not _is_s(x) and not _is_l(x) and not _is_n(x)
    k = _run(text, j, punct)
    if k > j:
        return _run(text, k, lambda x: x in "\r\n") - i
    # \s*[\r\n]+
    k = _run(text, i, _is_s)
    last_nl = max((p for p in range(i, k) if text[p] in "\r\n"), default=-1)
    if last_nl >= 0:
        return last_nl + 1 - i
    # \s+(?!\S) | \s+
    return _space_alternatives(text, i)


def _match_gpt2(text, i):
    n = _contraction(text, i, caseless=False)
    if n:
        return n
    c = text[i]
    j = i + 1 if c == " " and i + 1 < len(text) else i
    for pred in (_is_l, _is_n, lambda x: not _is_s(x) and not _is_l(x) and not _is_n(x)):
        k = _run(text, j, pred)
        if k > j:
            return k - i
    return _space_alternatives(text, i)


def pretokenize(text: str, style: str = "llama3"):
    """The pieces the exported pre-tokenizer regex makes of text (valid Unicode text)."""
    match = _match_llama3 if style == "llama3" else _match_gpt2
    pieces, i = [], 0
    while i < len(text):
        n = match(text, i)
        assert n > 0, (style, i, text[i:i + 10])
        pieces.append(text[i:i + n])
        i += n
    return pieces


# ---- training ----

def train_bpe(text: str, vocab_size: int, style: str = "llama3") -> dict:
    """A tokenizer.json dict with exactly vocab_size ids, trained on text."""
    if style not in ("llama3", "gpt2"):
        raise ValueError(f"style must be 'llama3' or 'gpt2', not {style!r}")
    n_bpe = vocab_size - len(SPECIAL_TOKENS)
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} is below 256 byte tokens + "
                         f"{len(SPECIAL_TOKENS)} special tokens")

    tokens = [bytes([b]) for b in BYTE_ORDER]          # id -> bytes
    ids = {t: i for i, t in enumerate(tokens)}         # bytes -> id
    counts = {}
    for piece in pretokenize(text, style):
        counts[piece] = counts.get(piece, 0) + 1
    words = [[ids[bytes([b])] for b in w.encode("utf-8")] for w in counts]
    freqs = list(counts.values())

    pair_count, where = {}, {}
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] = pair_count.get(p, 0) + freqs[wi]
            where.setdefault(p, set()).add(wi)
    heap = [(-c, tokens[a], tokens[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    merges = []
    while len(tokens) < n_bpe:
        if not heap:
            raise ValueError(f"the corpus is too small for vocab_size {vocab_size}: no pairs left "
                             f"after {len(merges)} merges ({len(tokens)} BPE tokens)")
        negc, ta, tb, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale: a fresher entry for this pair is in the heap
        new = ta + tb
        if new not in ids:  # two merge paths can spell the same bytes: reuse the id
            ids[new] = len(tokens)
            tokens.append(new)
        new_id = ids[new]
        merges.append((a, b))
        touched = set()
        for wi in sorted(where.pop((a, b))):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                touched.add(p)
            nw, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    nw.append(new_id)
                    i += 2
                else:
                    nw.append(w[i])
                    i += 1
            words[wi] = nw
            for p in zip(nw, nw[1:]):
                pair_count[p] = pair_count.get(p, 0) + f
                where.setdefault(p, set()).add(wi)
                touched.add(p)
        pair_count.pop((a, b), None)
        touched.discard((a, b))
        for p in sorted(touched):
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, tokens[p[0]], tokens[p[1]], p[0], p[1]))
            else:
                pair_count.pop(p, None)

    return _tokenizer_json(tokens, merges, style)


def _tokenizer_json(tokens, merges, style):
    vocab = {to_bytelevel(t): i for i, t in enumerate(tokens)}
    if style == "llama3":
        json_merges = [[to_bytelevel(tokens[a]), to_bytelevel(tokens[b])] for a, b in merges]
    else:
        json_merges = [to_bytelevel(tokens[a]) + " " + to_bytelevel(tokens[b]) for a, b in merges]
    first_special = len(tokens)
    added = [{"id": first_special + k, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for k, s in enumerate(SPECIAL_TOKENS)]
    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": True}
    if style == "llama3":
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
             "invert": False},
            dict(bytelevel, use_regex=False)]}
        bos = SPECIAL_TOKENS[0]
        post = {"type": "Sequence", "processors": [
            dict(bytelevel, trim_offsets=False),
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [first_special], "tokens": [bos]}}}]}
    else:
        pre = bytelevel
        post = dict(bytelevel, trim_offsets=False)
    model = {"type": "BPE", "dropout": None, "unk_token": None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
             "byte_fallback": False}
    if style == "llama3":
        model["ignore_merges"] = True
    model["vocab"] = vocab
    model["merges"] = json_merges
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": pre, "post_processor": post,
            "decoder": dict(bytelevel), "model": model}


# ---- reference encoder (slow; for cross-checking the C tokenizer in tests) ----

def encode(tj: dict, text: str, allow_special: bool = True):
    """Token ids of text under a dict made by train_bpe (either style)."""
    model = tj["model"]
    vocab = {from_bytelevel(s): i for s, i in model["vocab"].items()}
    ranks = {}
    for r, m in enumerate(model["merges"]):
        a, b = m.split(" ") if isinstance(m, str) else m
        ranks.setdefault((from_bytelevel(a), from_bytelevel(b)), r)
    style = "llama3" if model.get("ignore_merges") else "gpt2"
    specials = sorted(((a["content"], a["id"]) for a in tj["added_tokens"]),
                      key=lambda x: -len(x[0]))
    cache = {}

    def bpe(piece: bytes):
        if style == "llama3" and piece in vocab:
            return [vocab[piece]]
        syms = [bytes([b]) for b in piece]
        while len(syms) > 1:
            best = min(range(len(syms) - 1),
                       key=lambda k: (ranks.get((syms[k], syms[k + 1]), 1 << 62), k))
            if (syms[best], syms[best + 1]) not in ranks:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        return [vocab[s] for s in syms]

    out, seg, i = [], 0, 0
    while i <= len(text):
        hit = None
        if allow_special and i < len(text):
            hit = next(((c, t) for c, t in specials if text.startswith(c, i)), None)
        if hit is None and i < len(text):
            i += 1
            continue
        for piece in pretokenize(text[seg:i], style):
            if piece not in cache:
                cache[piece] = bpe(piece.encode("utf-8"))
            out.extend(cache[piece])
        if hit is None:
            break
        out.append(hit[1])
        i += len(hit[0])
        seg = i
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="UTF-8 training text")
    ap.add_argument("--vocab-size", type=int, required=True,
                    help="number of ids including the 5 special tokens")
    ap.add_argument("--style", choices=("llama3", "gpt2"), default="llama3")
    ap.add_argument("--out", required=True, help="tokenizer.json to write")
    ap.add_argument("--encode", help="also encode this UTF-8 file with the reference encoder")
    ap.add_argument("--ids-out", help="where --encode writes its ids, one line, space-separated")
    args = ap.parse_args(argv)
    # newline="": keep "\r\n" as it is; the tokenizer sees the bytes of the file.
    with open(args.corpus, encoding="utf-8", newline="") as f:
        text = f.read()
    try:
        tj = train_bpe(text, args.vocab_size, args.style)
    except ValueError as e:
        print(f"bpe_train.py: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    if args.encode:
        if not args.ids_out:
            print("bpe_train.py: --encode needs --ids-out", file=sys.stderr)
            return 2
        with open(args.encode, encoding="utf-8", newline="") as f:
            ids = encode(tj, f.read())
        with open(args.ids_out, "w") as f:
            f.write(" ".join(map(str, ids)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
