#!/usr/bin/env bash
# tests/jinja/run.sh — the CTest entry comparing gw_jinja with @huggingface/jinja (README.md here).
# Usage: run.sh JINJA_RENDER
#   renders tests/jinja/templates/*.jinja × tests/jinja/cases/*.json with both and requires byte
#   equality (or both raising). Without node or the @huggingface/jinja package: skipped (exit 77),
#   except under CI=true, where that is a failure.
set -euo pipefail

driver=$1
here=$(cd "$(dirname "$0")" && pwd)
module=$(cd "$here/../.." && pwd)/.deps/node_modules/@huggingface/jinja

missing() {
  if [ "${CI:-}" = true ]; then
    echo "jinja: $1 (tools/setup.sh installs it); CI=true, so this is a failure" >&2
    exit 1
  fi
  echo "jinja: skipped: $1 (run tools/setup.sh)"
  exit 77
}
command -v node >/dev/null 2>&1 || missing "no node on PATH"
[ -f "$module/dist/index.js" ] || missing "no npm package @huggingface/jinja in $module"

exec node "$here/compare.mjs" "$driver" "$here/templates" "$here/cases" "$module"
