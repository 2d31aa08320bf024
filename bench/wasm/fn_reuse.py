#!/usr/bin/env python3
"""fn_reuse.py — how much of a new module a per-function compile cache could reuse.

Compares the function bodies of an old and a new build of a module (e.g. before and after a
one-line edit): how many bodies of NEW are byte-identical to a body of OLD, at the same index
and anywhere, and what share of NEW's code bytes that is; and which other sections differ (a
cache key would have to include whatever its functions' C depends on: types, imports, the
function and global *types*, the name section — but not global initial values or data
contents, which move with every new string; see bench/results/wasm.md, "Cold start: where the
time goes").

Usage: bench/wasm/fn_reuse.py OLD.wasm NEW.wasm [NEWER.wasm ...]
"""
import sys


def leb(b, i):
    r = s = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << s
        s += 7
        if x < 0x80:
            return r, i


def sections(path):
    """[(id, custom name or '', payload bytes)] in file order."""
    b = open(path, "rb").read()
    if b[:4] != b"\0asm":
        sys.exit(f"fn_reuse.py: {path} is not a wasm module")
    i, out = 8, []
    while i < len(b):
        sid = b[i]
        n, i = leb(b, i + 1)
        name = ""
        if sid == 0:
            ln, j = leb(b, i)
            name = b[j:j + ln].decode("utf-8", "replace")
        out.append((sid, name, b[i:i + n]))
        i += n
    return out


def bodies(secs):
    for sid, _, p in secs:
        if sid == 10:
            cnt, j = leb(p, 0)
            out = []
            for _ in range(cnt):
                sz, j = leb(p, j)
                out.append(p[j:j + sz])
                j += sz
            return out
    return []


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    old = sections(sys.argv[1])
    ob = bodies(old)
    known = set(ob)
    for path in sys.argv[2:]:
        new = sections(path)
        nb = bodies(new)
        same_idx = sum(1 for x, y in zip(ob, nb) if x == y)
        anywhere = [y for y in nb if y in known]
        share = 100.0 * sum(map(len, anywhere)) / max(1, sum(map(len, nb)))
        old_by = {(s, n): p for s, n, p in old}
        differ = [f"{s}{'/' + n if n else ''}" for s, n, p in new
                  if s != 10 and old_by.get((s, n)) != p]
        print(f"{path}: {len(nb)} functions ({len(ob)} before); identical at the same index "
              f"{same_idx}, identical anywhere {len(anywhere)}, {share:.1f}% of the code bytes; "
              f"other sections that differ (id/name): {', '.join(differ) or 'none'}")


if __name__ == "__main__":
    main()
