#!/usr/bin/env bash
# deploy/local/pie-local.sh — runs a Pie-C cluster as processes on loopback: one controller,
# N workers and M lifecycle replicas, each with its own log under the run directory. Waits
# until every service reports SERVING, prints the cluster status, then runs until Ctrl-C (or
# exits at once with --check) and stops everything with SIGTERM.
#
# Ports (base B, default 50050): lifecycle replica i at B+1+10i, controller at B+2, worker i at
# B+3+10i; each service's /metrics at its gRPC port + 10000.
set -euo pipefail

workers=1 lifecycles=1 base=50050 check=0 token="${PIE_TOKEN:-}"
bin="$(cd "$(dirname "$0")/../.." && pwd)/build/bin"
rundir="" model=""
usage() {
  cat <<USAGE
usage: $0 [--workers N] [--lifecycles M] [--base-port B|random] [--bin DIR] [--run-dir DIR]
          [--token TOKEN] [--model DIR] [--check]
  --model   Hugging Face model directory every worker serves (default: the build's generated
            test model, BIN/../models/tiny-f32)
  --check   start, wait for health, print status, stop (exit status = health)
USAGE
}
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers=$2; shift 2 ;;
    --lifecycles) lifecycles=$2; shift 2 ;;
    --base-port) base=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --run-dir) rundir=$2; shift 2 ;;
    --token) token=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
# "random": a base in 10000..29900, below Linux's ephemeral range (tests run beside others).
if [ "$base" = random ]; then base=$((10000 + (RANDOM % 200) * 100)); fi
[ -x "$bin/pie-controller" ] || { echo "pie-local: no binaries in $bin (build first)" >&2; exit 2; }
model=${model:-$bin/../models/tiny-f32}
[ -f "$model/config.json" ] || { echo "pie-local: no model in $model (pass --model DIR, or build the test models)" >&2; exit 2; }
model=$(cd "$model" && pwd)
rundir=${rundir:-$(mktemp -d /tmp/pie-local.XXXXXX)}
mkdir -p "$rundir"
export PIE_AUTH_TOKEN="$token" PIE_TOKEN="$token"

pids=()
stop_all() {
  trap - INT TERM EXIT
  echo "pie-local: stopping (SIGTERM)"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  local rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  echo "pie-local: stopped; logs in $rundir"
  return $rc
}
trap 'stop_all; exit 130' INT TERM
trap 'stop_all' EXIT

start() { # name port log-name [env...]
  local name=$1 port=$2 log=$3
  shift 3
  env "$@" PIE_SERVER_LISTEN="127.0.0.1:$port" PIE_METRICS_LISTEN="127.0.0.1:$((port + 10000))" \
    "$bin/pie-$name" >"$rundir/$log.log" 2>&1 &
  pids+=($!)
  addrs+=("127.0.0.1:$port")
}

addrs=()
ctl=$((base + 2))
start controller "$ctl" controller
for ((i = 0; i < workers; i++)); do
  start worker $((base + 3 + 10 * i)) "worker-$i" PIE_CONTROLLER_ADDRESS="127.0.0.1:$ctl" \
    PIE_WORKER_GROUP_ID="worker-$i" PIE_MODEL_PATH="$model"
done
for ((i = 0; i < lifecycles; i++)); do
  # Replicas share one program store and native-code cache (content-addressed, written
  # atomically); the tokenizer of the model comes from the model directory itself.
  start lifecycle $((base + 1 + 10 * i)) "lifecycle-$i" PIE_CONTROLLER_ADDRESS="127.0.0.1:$ctl" \
    PIE_REPLICA_ID="lifecycle-$i" PIE_RUNTIME_CACHE_DIR="$rundir/cache" PIE_TOKENIZER_PATH="$model"
done

health_args=()
for a in "${addrs[@]}"; do health_args+=(--addr "$a"); done
echo "pie-local: $workers worker(s), $lifecycles lifecycle replica(s), controller at 127.0.0.1:$ctl; logs in $rundir"
ok=0
"$bin/piectl" --wait 10000 "${health_args[@]}" health || ok=1
# Registration is asynchronous: wait until the controller sees every worker and replica.
linked=0
for _ in $(seq 100); do
  out=$("$bin/piectl" --addr "127.0.0.1:$ctl" status 2>&1 || true)
  if echo "$out" | grep -q "^workers ($workers)" && echo "$out" | grep -q "^lifecycle replicas ($lifecycles)"; then
    linked=1; break
  fi
  sleep 0.1
done
[ $linked = 1 ] || { echo "pie-local: the controller did not see $workers worker(s) and $lifecycles replica(s) within 10 s" >&2; ok=1; }
"$bin/piectl" --addr "127.0.0.1:$ctl" status || ok=1
if [ $check = 1 ]; then
  stop_all || ok=1
  exit $ok
fi
echo "pie-local: running; public API (pie.v1.Lifecycle) at 127.0.0.1:$((base + 1)). Ctrl-C stops."
wait
