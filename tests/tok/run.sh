#!/usr/bin/env bash
# tests/tok/run.sh — one CTest entry of the tokenizer check against tiktoken (README.md here).
# Usage: run.sh ENCODING OUT_DIR TOK_REF_CHECK [N_RANDOM]
#   writes pie_tok's view of the Unicode classes, the reference's tokenizer.json and cases into
#   OUT_DIR, then checks pie_tok against them. Without node or the tiktoken package: skipped
#   (exit 77), except under CI=true, where that is a failure.
set -euo pipefail

enc=$1 out=$2 check=$3 n_random=${4:-3000}
here=$(cd "$(dirname "$0")" && pwd)
modules=$(cd "$here/../.." && pwd)/.deps/node_modules

missing() {
  if [ "${CI:-}" = true ]; then
    echo "tok-ref: $1 (tools/setup.sh installs it); CI=true, so this is a failure" >&2
    exit 1
  fi
  echo "tok-ref: skipped: $1 (run tools/setup.sh)"
  exit 77
}
command -v node >/dev/null 2>&1 || missing "no node on PATH"
[ -f "$modules/tiktoken/encoders/$enc.json" ] || missing "no npm package tiktoken in $modules"

mkdir -p "$out"
"$check" classes "$out/pcre2-classes.txt"
NODE_PATH=$modules node "$here/tiktoken_ref.js" "$enc" "$out" "$out/pcre2-classes.txt" "$n_random"
"$check" check "$enc" "$out/tokenizer.json" "$out/cases.txt"
