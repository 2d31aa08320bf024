#!/usr/bin/env bash
# bench/lifecycle/store_scan.sh — what a replica pays to count its program store, by size.
#
#   bench/lifecycle/store_scan.sh [--bin build/bin] [--programs 1000,10000]
#
# The replica counts programs/ by a scan (replicas may share the directory): at each upload
# (twice: before the compile and before the write, programs.store_size and the tenant's quota
# program_bytes) and at each metrics scrape. For each size this fills a scratch cache directory
# with that many stored programs (1,000-byte modules, a label and one tenant's hold each),
# starts pie-lifecycle on it (no controller needed) and times five scrapes of /metrics, beside
# five of an empty store: the difference is one scan.
set -euo pipefail
bin=build/bin
sizes=1000,10000
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --programs) sizes=$2; shift 2 ;;
    *) echo "usage: $0 [--bin DIR] [--programs N,N...]" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d "${TMPDIR:-/tmp}/pie-store-scan.XXXXXX")
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
port=$((20000 + RANDOM % 20000))

scrapes() { # DIR: five scrape times in ms
  PIE_RUNTIME_CACHE_DIR=$1 PIE_METRICS_LISTEN=127.0.0.1:$port PIE_SERVER_LISTEN=127.0.0.1:$((port + 1)) \
    PIE_CONTROLLER_ADDRESS=127.0.0.1:1 "$bin/pie-lifecycle" >"$work/lc.log" 2>&1 &
  pid=$!
  for _ in $(seq 50); do curl -sf -o /dev/null "http://127.0.0.1:$port/healthz" && break; sleep 0.1; done
  local out=""
  for _ in 1 2 3 4 5; do
    out="$out $(curl -s -o /dev/null -w '%{time_total}' "http://127.0.0.1:$port/metrics" | awk '{printf "%.1f", $1 * 1000}')"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  echo "$out"
}

mkdir -p "$work/empty"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "empty store: scrape ms$(scrapes "$work/empty")"
for n in ${sizes//,/ }; do
  d="$work/n$n"; mkdir -p "$d/programs"
  /usr/bin/python3 - "$d/programs" "$n" <<'PY'
import hashlib, os, sys
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    h = hashlib.sha256(str(i).encode()).hexdigest()
    with open(os.path.join(d, h + '.wasm'), 'wb') as f: f.write(b'\0' * 1000)
    with open(os.path.join(d, h + '.meta'), 'w') as f: f.write('0\nbench')
    open(os.path.join(d, h + '.by.alice'), 'w').close()
PY
  echo "$n programs: scrape ms$(scrapes "$d")"
  rm -rf "$d"
done
