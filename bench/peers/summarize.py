#!/usr/bin/python3
"""summarize.py — the table of one model's peer rounds (bench/peers/run.sh's raw outputs).

Reads DIR/r<round>-pie-<i>.txt (bench_engine's Markdown rows after a "# load average" line) and
DIR/r<round>-llama.txt (llama_bench.mjs's JSON lines after the same line) and prints a Markdown
table: per measurement, each engine's median tok/s in every round, the ratio Pie-C / llama.cpp in
every round (both engines of a round ran back to back, so they saw about the same load), and
the min / median / max of those ratios. Decode b=1 comes from each round's first bench_engine
run (the others measure it again; those numbers are in the raw files).

Usage: summarize.py DIR
"""

import glob
import json
import os
import re
import statistics
import sys

PIE_ROWS = [
    (re.compile(r"^\| decode b=1 @(\d+) ctx \(forward \+ next_dist\).*?\| ([\d.]+) \(([\d.]+)\) tok/s"),
     lambda m: f"decode b=1 @{m[1]}", 2),
    (re.compile(r"^\| decode b=(\d+) @(\d+) ctx, median \(best\) \| ([\d.]+) \(([\d.]+)\) tok/s"),
     lambda m: f"decode b={m[1]} @{m[2]}", 3),
    (re.compile(r"^\| prefill (\d+) tokens \| ([\d.]+) tok/s"), lambda m: f"prefill {m[1]}", 2),
]
CPU_SHARE = re.compile(r"CPU share of this run: .*?, (\d+)% of (\d+) threads")
LOAD = re.compile(r"^# load average before: ([\d.]+) ([\d.]+) ([\d.]+)")


def order(measure):
    """decode rows by batch, then prefill rows by length."""
    n = int(re.search(r"(\d+)", measure)[1])
    return (0 if measure.startswith("decode") else 1, n)


def read_pie(path, first):
    out, share, load = {}, None, None
    with open(path) as f:
        for line in f:
            m = LOAD.match(line)
            if m:
                load = m[1]
            m = CPU_SHARE.search(line)
            if m:
                share = int(m[1])
            for rx, name, col in PIE_ROWS:
                m = rx.match(line)
                if not m:
                    continue
                key = name(m)
                if key.startswith("decode b=1 ") and not first:
                    continue
                if key not in out:
                    out[key] = float(m[col])
    return out, share, load


def read_llama(path):
    out, load, share = {}, None, None
    with open(path) as f:
        for line in f:
            m = LOAD.match(line)
            if m:
                load = m[1]
            m = CPU_SHARE.search(line)
            if m:
                share = int(m[1])
            if line.startswith("{"):
                r = json.loads(line)
                out[r["measure"]] = r["tps"]
    return out, load, share


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("Usage: ")[1].strip(), file=sys.stderr)
        sys.exit(2)
    d = sys.argv[1]
    rounds = sorted({int(re.match(r"r(\d+)-", os.path.basename(p))[1])
                     for p in glob.glob(os.path.join(d, "r*-*.txt"))})
    pie, llama, notes = {}, {}, []
    for r in rounds:
        pie[r], shares, loads = {}, [], []
        for p in sorted(glob.glob(os.path.join(d, f"r{r}-pie-*.txt"))):
            vals, share, load = read_pie(p, p.endswith("-pie-0.txt"))
            for k, v in vals.items():
                pie[r].setdefault(k, v)
            shares.append(share)
            loads.append(load)
        llama[r], lload, lshare = {}, None, None
        lp = os.path.join(d, f"r{r}-llama.txt")
        if os.path.exists(lp):
            llama[r], lload, lshare = read_llama(lp)
        notes.append(f"round {r}: 1-min load average before Pie-C's runs {', '.join(str(x) for x in loads)}"
                     f" (bench_engine's CPU share {', '.join(f'{s}%' for s in shares if s is not None)})"
                     f", before llama.cpp's {lload}"
                     + (f" (its CPU share {lshare}%)" if lshare is not None else ""))
    measures = sorted({k for r in rounds for k in pie[r]} & {k for r in rounds for k in llama[r]},
                      key=order)
    print("| measure | Pie-C tok/s (rounds " + ", ".join(map(str, rounds)) + ") | llama.cpp tok/s | "
          "Pie-C / llama.cpp per round | ratio min / median / max |")
    print("| --- | --- | --- | --- | --- |")
    for m in measures:
        ps = [pie[r].get(m) for r in rounds]
        ls = [llama[r].get(m) for r in rounds]
        ratios = [p / l for p, l in zip(ps, ls) if p and l]
        fmt = lambda v: " / ".join("–" if x is None else f"{x:.2f}" for x in v)
        summary = (f"{min(ratios):.2f}× / **{statistics.median(ratios):.2f}×** / {max(ratios):.2f}×"
                   if ratios else "–")
        print(f"| {m} | {fmt(ps)} | {fmt(ls)} | {fmt(ratios)} | {summary} |")
    print()
    for n in notes:
        print(f"* {n}")


if __name__ == "__main__":
    main()
