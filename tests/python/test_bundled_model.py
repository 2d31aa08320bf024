"""The bundled model (models/pie-tiny, made by tools/tinymodel/train_tiny.py) still shows the
behaviour it was trained for: greedy decoding from the start of a sentence of
tools/tinymodel/corpus.txt continues that sentence as the corpus does.

Owns: the behavioural check of the committed weights, once with the float64 reference
(ref_llama.py, no C code) and once with the C engine through pie-engine-probe
(tools/engine-probe/PROTOCOL.md), whose greedy ids must equal the reference's.
Does not own: the forward-pass comparison on random models (test_forward_reference.py), the
training (train_tiny.py).

The expected text is read from corpus.txt at run time (the continuation of the prompt where it
occurs), not stored here. A prompt passes when the model's greedy text and the corpus agree on
at least MIN_CHARS characters. The engine test skips (loudly) only when the probe was not
built."""

import json
import os
import subprocess
import sys
import unittest

import torch

sys.dont_write_bytecode = True  # keep the source tree clean when run by hand
import ref_llama  # noqa: E402
from pie_require import require  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("PIE_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
MODEL_DIR = os.path.join(SOURCE_DIR, "models", "pie-tiny")
TINYMODEL_DIR = os.path.join(SOURCE_DIR, "tools", "tinymodel")
PROBE = os.path.join(os.environ.get("PIE_BIN_DIR", ""), "pie-engine-probe")

STEPS = 32          # greedy tokens per prompt (about 100 characters of this corpus)
MIN_CHARS = 64      # characters that must agree with the corpus's continuation
PAGE_SIZE = 16
PROBE_TIMEOUT_S = 60

# (prompt, with BOS): a section title, a paragraph start, and a sentence from the middle of a
# paragraph typed without its leading space; with and without <|begin_of_text|>.
PROMPTS = [("Every Saturday the square", False),
           ("How to Make a Simple Soup", True),
           ("Mrs. Okafor, who sells eggs and honey,", False)]

torch.set_num_threads(1)
sys.path.insert(0, TINYMODEL_DIR)
import bpe_train  # noqa: E402 (the repo's reference BPE encoder)


class Tokenizer:
    """tokenizer.json of the model: encoding by bpe_train.encode, decoding by the vocabulary."""

    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
            self.tj = json.load(f)
        self.bytes_of = {i: bpe_train.from_bytelevel(s)
                         for s, i in self.tj["model"]["vocab"].items()}
        self.bos = next(t["id"] for t in self.tj["added_tokens"]
                        if t["content"] == "<|begin_of_text|>")

    def encode(self, text, bos):
        return ([self.bos] if bos else []) + bpe_train.encode(self.tj, text, allow_special=False)

    def decode(self, ids):
        return b"".join(self.bytes_of.get(i, b"?") for i in ids).decode("utf-8", "replace")


def corpus_continuation(prompt):
    with open(os.path.join(TINYMODEL_DIR, "corpus.txt"), encoding="utf-8") as f:
        text = f.read()
    at = text.find(prompt)
    if at < 0:
        raise AssertionError(f"prompt {prompt!r} does not occur in corpus.txt")
    return text[at + len(prompt):]


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_greedy(model, ids, steps):
    """Argmax decoding (ties → lowest id) with the float64 reference; also the top-1/top-2
    logit margin of each step, to tell a flipped near tie from a real difference."""
    ids, out, margins = list(ids), [], []
    for _ in range(steps):
        lg = model.dense_logits(ids)[-1]
        top2 = torch.topk(lg, 2).values
        nxt = int(torch.argmax(lg))
        out.append(nxt)
        margins.append(float(top2[0] - top2[1]))
        ids.append(nxt)
    return out, margins


class BundledModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")):
            raise AssertionError(f"{MODEL_DIR}/model.safetensors is missing: the bundled model "
                                 f"is part of the repo (tools/tinymodel/train_tiny.py makes it)")
        cls.tok = Tokenizer(MODEL_DIR)
        cls.model = ref_llama.LlamaModel.from_dir(MODEL_DIR)
        cls.ref = {}
        for prompt, bos in PROMPTS:
            ids = cls.tok.encode(prompt, bos)
            cls.ref[prompt] = (ids,) + reference_greedy(cls.model, ids, STEPS)

    def test_size_is_at_most_20_mb(self):
        size = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))
        self.assertLessEqual(size, 20_000_000, f"{MODEL_DIR} holds {size} bytes")

    def test_reference_continues_the_corpus(self):
        for prompt, bos in PROMPTS:
            with self.subTest(prompt=prompt, bos=bos):
                _, gen, _ = self.ref[prompt]
                text, want = self.tok.decode(gen), corpus_continuation(prompt)
                n = common_prefix(text, want)
                self.assertGreaterEqual(
                    n, MIN_CHARS, f"{prompt!r} (bos={bos}): greedy text {text!r} leaves the "
                    f"corpus after {n} characters; the corpus goes on {want[:len(text)]!r}")

    def test_engine_greedy_equals_reference(self):
        require(self, os.access(PROBE, os.X_OK),
                f"pie-engine-probe not found at {PROBE!r} (PIE_BIN_DIR): the build makes it; a "
                f"skip here means the build is incomplete")
        ops, n_pages = [], (64 + STEPS + PAGE_SIZE - 1) // PAGE_SIZE
        for k, (prompt, _) in enumerate(PROMPTS):
            ids = self.ref[prompt][0]
            ops.append({"op": "greedy", "tokens": ids, "steps": STEPS,
                        "pages": list(range(k * n_pages, (k + 1) * n_pages)),
                        "slot_base": k * 64})
        cmd = [PROBE, "--model", MODEL_DIR, "--page-size", str(PAGE_SIZE), "--pages",
               str(len(PROMPTS) * n_pages), "--slots", str(64 * len(PROMPTS))]
        proc = subprocess.run(cmd, input=json.dumps({"ops": ops}).encode(), capture_output=True,
                              timeout=PROBE_TIMEOUT_S)
        self.assertEqual(proc.returncode, 0, f"{' '.join(cmd)}: exit {proc.returncode}, "
                         f"stderr {proc.stderr.decode(errors='replace')!r}")
        results = json.loads(proc.stdout)["results"]
        for (prompt, bos), res in zip(PROMPTS, results):
            with self.subTest(prompt=prompt, bos=bos):
                self.assertNotIn("error", res, f"{prompt!r}: probe error {res}")
                _, want, margins = self.ref[prompt]
                got = res["tokens"]
                first = common_prefix(got, want)
                self.assertEqual(
                    got, want, f"{prompt!r}: engine {self.tok.decode(got)!r} vs reference "
                    f"{self.tok.decode(want)!r}; first difference at step {first} where the "
                    f"reference's top-1/top-2 margin is "
                    f"{margins[min(first, len(margins) - 1)]:.4f}")


if __name__ == "__main__":
    unittest.main()
