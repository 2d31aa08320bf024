#!/usr/bin/python3
"""bench_transformers.py — Hugging Face transformers on the shapes of bench_cuda.c, on the same
GPU: the baseline of issue #6's "at least 3x faster" targets.

Owns: three timings of LlamaForCausalLM (bf16 weights and activations, attn_implementation
"sdpa", the KV cache transformers keeps itself), for one model directory:
  decode b=1   one token per step after a --context token prompt, median ms/token over --steps
  decode b=B   --batch sequences of --context tokens, one token each per step: tokens/s
  prefill      one forward of --prefill tokens: tokens/s (median of 3 after a warm-up)
Token ids are deterministic; random-weight models make any id as good as another.
Does not own: our numbers (bench/cuda/bench_cuda.c) or their record (bench/results/cuda.md).

Usage (GPU machine):
  /usr/bin/python3 bench/cuda/bench_transformers.py --model /tmp/l8b [--context 1024]
      [--batch 64] [--prefill 2048] [--steps 32]
Prints "skipped: ..." and exits 0 without a CUDA device or without transformers."""

import argparse
import statistics
import sys
import time


def skip(why):
    print(f"skipped: {why}")
    sys.exit(0)


def timed(torch, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def decode_rate(torch, m, batch, context, steps, vocab):
    """Median seconds per decode step for `batch` sequences after `context` prompt tokens."""
    ids = (torch.arange(batch * context, device="cuda").reshape(batch, context) * 7919 + 13) % vocab
    with torch.no_grad():
        out = m(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps + 1):
            dt, out = timed(torch, lambda: m(nxt, past_key_values=past, use_cache=True))
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            # the same work as our next_dist: softmax and top-256 per sequence
            torch.topk(torch.softmax(logits, -1), 256)
            nxt = logits.argmax(-1, keepdim=True)
            times.append(dt)
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        skip("torch is not installed")
    if not torch.cuda.is_available():
        skip("no CUDA device visible to torch (no GPU, or a CPU-only torch such as Debian's "
             "python3-torch: a CUDA build of torch is needed for this baseline)")
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        skip("transformers is not installed")
    m = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                         attn_implementation="sdpa").to("cuda").eval()
    vocab = m.config.vocab_size
    print(f"model {args.model}: transformers, bf16, sdpa; device {torch.cuda.get_device_name()}")
    print("| measurement | value |\n| --- | --- |")
    ids = (torch.arange(args.prefill, device="cuda")[None] * 104729 + 13) % vocab
    with torch.no_grad():
        timed(torch, lambda: m(ids))  # warm-up
        tp = statistics.median(timed(torch, lambda: m(ids))[0] for _ in range(3))
    print(f"| prefill {args.prefill} tokens | {args.prefill / tp:.0f} tok/s ({tp * 1e3:.1f} ms) |")
    t1 = decode_rate(torch, m, 1, args.context, args.steps, vocab)
    print(f"| decode b=1 @{args.context} ctx, median of {args.steps} | {t1 * 1e3:.3f} ms/token |")
    tb = decode_rate(torch, m, args.batch, args.context, args.steps, vocab)
    print(f"| decode b={args.batch} @{args.context} ctx, median of {args.steps} | "
          f"{args.batch / tb:.0f} tok/s |")


if __name__ == "__main__":
    main()
