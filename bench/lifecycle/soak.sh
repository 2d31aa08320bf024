#!/usr/bin/env bash
# bench/lifecycle/soak.sh — what a cluster holds after many short instances and many distinct
# programs: resident memory, open files, threads and mappings of every service, sampled as the
# load goes on. A service whose figures keep growing with the count holds something per
# instance or per program that it never gives back.
#
# Starts a cluster on loopback (deploy/local/pie-local.sh) from BIN (default build/bin) on the
# build's generated model, then
#   phase 1: N rounds (--instances, default 400) of one `piectl run text_completion.wasm` and
#            one gateway /v1/completions request, 8 tokens each;
#   phase 2: P distinct programs (--programs, default 60) uploaded: text_completion.wasm with
#            a custom section numbering it (same code, another SHA-256);
# and prints a sample line per service (and each replica's disk) every --every rounds of each
# phase.
# Usage: bench/lifecycle/soak.sh [--bin DIR] [--instances N] [--programs P] [--every K]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$root/build/bin" instances=400 programs=60 every=100
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --instances) instances=$2; shift 2 ;;
    --programs) programs=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "soak: unknown option $1" >&2; exit 2 ;;
  esac
done
wasm="$(cd "$bin/.." && pwd)/inferlets/text_completion.wasm"
[ -f "$wasm" ] || { echo "soak: $wasm not built" >&2; exit 2; }

if [ -z "${PIE_LOCAL_RUN_DIR:-}" ]; then # not yet inside the cluster: start it and come back
  exec bash "$root/deploy/local/pie-local.sh" --bin "$bin" --base-port random --exec \
    bash "$0" --bin "$bin" --instances "$instances" --programs "$programs" --every "$every"
fi

lc=${PIE_LOCAL_LIFECYCLES%% *} gw=${PIE_LOCAL_GATEWAYS%% *}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=$(curl -s "$gw/v1/models" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

sample() { # $1: label
  printf '%-22s' "$1"
  for f in "$PIE_LOCAL_RUN_DIR"/pids/*.pid; do
    local p n
    p=$(cat "$f") n=$(basename "$f" .pid)
    printf ' %s rss=%sk fd=%s thr=%s maps=%s;' "$n" \
      "$(awk '/VmRSS/{print $2}' "/proc/$p/status")" "$(ls "/proc/$p/fd" | wc -l)" \
      "$(awk '/Threads/{print $2}' "/proc/$p/status")" "$(wc -l < "/proc/$p/maps")"
  done
  for d in "$PIE_LOCAL_RUN_DIR"/cache-*; do # each replica's disk: programs, native code
    printf ' %s programs=%sk native=%sk;' "lifecycle-${d##*cache-}" \
      "$(du -sk "$d/programs" 2>/dev/null | cut -f1)" "$(du -sk "$d/native" 2>/dev/null | cut -f1)"
  done
  echo
}

failed=0
sample "start"
for i in $(seq 1 "$instances"); do
  "$PIE_LOCAL_BIN/piectl" --addr "$lc" run "$wasm" --prompt "Every Saturday the square $i" \
    --max-tokens 8 > /dev/null 2> "$tmp/err" < /dev/null || { failed=$((failed + 1)); cat "$tmp/err" >&2; }
  code=$(curl -s -m 30 -o /dev/null -w '%{http_code}' "$gw/v1/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"$model\",\"prompt\":\"Mrs. Okafor $i\",\"max_tokens\":8}")
  [ "$code" = 200 ] || { failed=$((failed + 1)); echo "soak: completion $i answered $code" >&2; }
  if [ $((i % every)) -eq 0 ]; then sample "instances $i"; fi
done
for i in $(seq 1 "$programs"); do
  /usr/bin/python3 - "$wasm" "$tmp/p.wasm" "$i" <<'PY'
import sys
src, dst, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = bytes([4]) + b"soak" + i.to_bytes(4, "little")  # a custom section: name, payload
open(dst, "wb").write(open(src, "rb").read() + bytes([0, len(body)]) + body)
PY
  "$PIE_LOCAL_BIN/piectl" --addr "$lc" --timeout 60000 upload "$tmp/p.wasm" "soak-$i" > /dev/null \
    2> "$tmp/err" || { failed=$((failed + 1)); cat "$tmp/err" >&2; }
  if [ $((i % (every / 5 > 0 ? every / 5 : 1))) -eq 0 ]; then sample "programs $i"; fi
done
echo "soak: $instances instances x 2 and $programs programs; $failed failed"
[ "$failed" -eq 0 ]
