#!/usr/bin/env bash
# cold_profile.sh — where a cold load's work goes, in instruction counts (callgrind), which stay
# the same on a shared machine where timings do not. Runs each step of lc_wasm's tier-0 compile
# (services/lifecycle/wasm/lc_wasm_compile.c) on its own, with the runtime's arguments:
#   wasm-validate        reading + validating (what wasm2c does before its first byte of C)
#   wasm2c               the whole translation (reading, validating, writing ~2 MB of C)
#   tcc headers          the prelude (t0.h, wasm-rt.h, libc headers) with an empty unit
#   tcc compile          wasm2c's C to an object (-c), as the pipeline compiles it
#   tcc link             that object to the shared library (-shared -lm)
# and, when bench_xlate is given (second argument; build it with --target bench_xlate), the
# tier-0 path of lc_wasm's own translator (services/lifecycle/wasm/lc_wasm_xlate.c):
#   own translator       bench_xlate: validating and writing the C, in process in the runtime
#   tcc own compile      its C to an object
#   tcc own link         that object to the shared library
# User-space instructions only: page faults and other kernel time are not in them (perf stat
# shows those: wasm2c spends ~15 of its ~37 ms of CPU in the kernel, mostly first-touch faults).
# Usage: bench/wasm/cold_profile.sh [module.wasm [build/bench/bench_xlate]]
#        (default module: the big fixture of build-h17)
# Needs valgrind, wasm2c, wasm-validate, tcc, python3. Results: bench/results/wasm.md.
set -euo pipefail
wasm=${1:-build-h17/tests/wasm/big.wasm}
xlate=${2:-}
[ -z "$xlate" ] || xlate=$(realpath "$xlate")
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$wasm" ] || { echo "cold_profile.sh: no $wasm (build the pie_wasm_fixtures target)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$wasm" "$work/module.wasm"
cd "$work"
# t0.h is the runtime's tcc prelude; take it from the source so that it never drifts.
python3 - "$here/../../services/lifecycle/wasm/lc_wasm_compile.c" > t0.h <<'EOF'
import re, sys
src = open(sys.argv[1]).read()
body = src.split("static const char tcc_prelude[] =", 1)[1].split(";\n", 1)[0]
print("".join(bytes(s, "utf-8").decode("unicode_escape") for s in re.findall(r'"((?:[^"\\]|\\.)*)"', body)))
EOF
: > wasm.h # the glue is a few lines; an empty one keeps the unit self-contained
echo 'int lc_empty;' > empty.c
count() { # label, command...
    local label=$1
    shift
    local ir
    ir=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 >/dev/null |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p')
    awk -v l="$label" -v n="$ir" 'BEGIN { printf "%-16s %8.1f M instructions\n", l, n / 1e6 }'
}
wasm2c module.wasm -n wprofile > module.c
printf '%s: %d bytes of wasm, %d bytes of C\n' "$wasm" "$(stat -c %s module.wasm)" "$(stat -c %s module.c)"
count "wasm-validate" wasm-validate module.wasm
count "wasm2c" wasm2c module.wasm -n wprofile -o out.c
count "tcc headers" tcc -c -o empty.o -include t0.h empty.c
count "tcc compile" tcc -c -o module.o -include t0.h module.c
count "tcc link" tcc -shared -o module.so module.o -lm
if [ -n "$xlate" ]; then
    "$xlate" module.wasm own.c
    printf 'own translator: %d bytes of C\n' "$(stat -c %s own.c)"
    count "own translator" "$xlate" module.wasm own2.c
    count "tcc own compile" tcc -c -o own.o own.c
    count "tcc own link" tcc -shared -o own.so own.o -lm
fi
