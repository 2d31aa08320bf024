#!/usr/bin/env bash
# deploy/local/pie-local.sh — runs a Pie-C cluster as processes on loopback: one controller,
# N workers, M lifecycle replicas and G OpenAI gateways, each with its own log under the run
# directory. Waits
# until every service reports SERVING and the controller sees every worker and replica, prints
# the cluster status, then runs until Ctrl-C (or exits at once with --check, or runs a command
# against the cluster with --exec) and stops everything with SIGTERM.
#
# Owns: the processes it starts, their logs, pid files and the cluster's address file.
# Does not own: building the binaries (tools/run.sh, CMake) or what a --exec command checks.
#
# Run directory: <name>.log per process, pids/<name>.pid, cluster.env (the PIE_LOCAL_* variables
# below, for `source` in another shell), cache-<i>/ (lifecycle replica i's programs, native code
# and fetched tokenizers: replicas share nothing on disk, as pods with an emptyDir each).
# Names: controller, worker-<i>, lifecycle-<i>, gateway-<i>.
#
# Ports (base B, default 50050): lifecycle replica i at B+1+10i, controller at B+2, worker i at
# B+3+10i, gateway i at B+4+10i (gRPC health) and B+5+10i (its OpenAI HTTP API); each service's
# /metrics at its gRPC port + 10000. The controller also listens on RUN_DIR/controller.sock, and
# the workers and replicas dial that Unix socket: across cores it costs a decode step less than
# loopback TCP (bench/results/controller.md); clients (piectl) use the port.
set -euo pipefail

workers=1 tp=1 lifecycles=1 gateways=auto base=50050 check=0 stay=0 token="${PIE_TOKEN:-}"
bin="$(cd "$(dirname "$0")/../.." && pwd)/build/bin"
rundir="" model="" wait_s=60
cmd=()
usage() {
  cat <<USAGE
usage: $0 [--workers N] [--tp T] [--lifecycles M] [--gateways G] [--base-port B|random] [--bin DIR]
          [--run-dir DIR] [--token TOKEN] [--model DIR] [--wait-s S] [--check | [--stay] --exec CMD [ARGS...]]
  --tp      tensor-parallel ranks of each worker (default 1): each worker is one pie-worker
            process that forks T rank processes (cpu backend; T must divide the model's heads)
  --gateways  OpenAI-compatible gateways (pie-gateway) in front of the lifecycle replicas
            (default 1 when the build has pie-gateway and its openai_chat.wasm, else 0)
  --model   Hugging Face model directory every worker serves (default: the build's generated
            test model, BIN/../models/tiny-f32)
  --wait-s  how long to wait for the cluster to become healthy and linked (default 60)
  --check   start, wait for health, print status, stop (exit status = health)
  --exec    (last option: the rest is the command) once the cluster is up, run CMD with the
            PIE_LOCAL_* variables below in its environment, then stop the cluster; the exit
            status is CMD's, or 1 if it succeeded and a service did not stop cleanly
  --stay    with --exec: when CMD succeeds, keep the cluster running until Ctrl-C
Environment of CMD (also written to RUN_DIR/cluster.env):
  PIE_LOCAL_RUN_DIR, PIE_LOCAL_BIN, PIE_LOCAL_MODEL, PIE_LOCAL_CONTROLLER (host:port),
  PIE_LOCAL_LIFECYCLES, PIE_LOCAL_WORKERS (space-separated host:port lists, index order),
  PIE_LOCAL_GATEWAYS (space-separated http://host:port base URLs of the gateways' APIs)
Each process's pid is in RUN_DIR/pids/<name>.pid. A service stopped on purpose (a failover
test) is taken out of the clean-stop check by removing its pid file.
USAGE
}
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers=$2; shift 2 ;;
    --tp) tp=$2; shift 2 ;;
    --lifecycles) lifecycles=$2; shift 2 ;;
    --gateways) gateways=$2; shift 2 ;;
    --base-port) base=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --run-dir) rundir=$2; shift 2 ;;
    --token) token=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --wait-s) wait_s=$2; shift 2 ;;
    --check) check=1; shift ;;
    --stay) stay=1; shift ;;
    --exec) shift; cmd=("$@"); [ ${#cmd[@]} -gt 0 ] || { usage >&2; exit 2; }; break ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
# "random": a base in 10000..29900, below Linux's ephemeral range (tests run beside others).
if [ "$base" = random ]; then base=$((10000 + (RANDOM % 200) * 100)); fi
[[ $tp =~ ^[1-9][0-9]*$ ]] || { echo "pie-local: --tp must be a positive integer, not '$tp'" >&2; exit 2; }
[ -x "$bin/pie-controller" ] || { echo "pie-local: no binaries in $bin (build first)" >&2; exit 2; }
bin=$(cd "$bin" && pwd)
model=${model:-$bin/../models/tiny-f32}
[ -f "$model/config.json" ] || { echo "pie-local: no model in $model (pass --model DIR, or build the test models)" >&2; exit 2; }
model=$(cd "$model" && pwd)
if [ "$gateways" = auto ]; then
  gateways=0
  [ -x "$bin/pie-gateway" ] && [ -f "$bin/../inferlets/openai_chat.wasm" ] && gateways=1
fi
rundir=${rundir:-$(mktemp -d /tmp/pie-local.XXXXXX)}
mkdir -p "$rundir/pids"
rundir=$(cd "$rundir" && pwd)
export PIE_AUTH_TOKEN="$token" PIE_TOKEN="$token"

names=() pids=()
declare -A ended=() # pid → exit status, for processes already reaped while the cluster ran
# Stops every process: SIGTERM, then waits. A process whose pid file is still there must exit 0;
# one whose pid file was removed was stopped on purpose by someone else: its status is shown only.
stop_all() {
  trap - INT TERM HUP EXIT
  echo "pie-local: stopping (SIGTERM)"
  local i
  for i in "${!pids[@]}"; do # not a reaped pid: the number may belong to another process now
    [ -n "${ended[${pids[$i]}]+set}" ] || kill -TERM "${pids[$i]}" 2>/dev/null || true
  done
  local rc=0 st
  for i in "${!pids[@]}"; do
    st=0
    if [ -n "${ended[${pids[$i]}]+set}" ]; then st=${ended[${pids[$i]}]}; else wait "${pids[$i]}" || st=$?; fi
    if [ -f "$rundir/pids/${names[$i]}.pid" ]; then
      [ "$st" = 0 ] || { echo "pie-local: ${names[$i]} (pid ${pids[$i]}) exited with status $st; see $rundir/${names[$i]}.log" >&2; rc=1; }
      rm -f "$rundir/pids/${names[$i]}.pid"
    else
      echo "pie-local: ${names[$i]} (pid ${pids[$i]}) had been stopped by someone else (status $st)"
    fi
  done
  echo "pie-local: stopped; logs in $rundir"
  return $rc
}
trap 'stop_all; exit 130' INT TERM HUP
trap 'stop_all' EXIT

# Each service runs in its own session (setsid: same pid, no fork here), so a terminal's Ctrl-C
# reaches only this script, which stops the services with one SIGTERM each.
start() { # name port [env...]
  local name=$1 port=$2
  shift 2
  local listen="127.0.0.1:$port"
  if [ "$name" = controller ] && [ -n "$ctl_sock" ]; then listen="$listen,unix:$ctl_sock"; fi
  setsid env "$@" PIE_SERVER_LISTEN="$listen" PIE_METRICS_LISTEN="127.0.0.1:$((port + 10000))" \
    "$bin/pie-${name%%-*}" >"$rundir/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
  echo $! >"$rundir/pids/$name.pid"
  addrs+=("127.0.0.1:$port")
}

addrs=() lc_addrs=() wrk_addrs=()
ctl=$((base + 2))
# A Unix socket's path must fit sun_path (108 bytes with its NUL); a longer run directory keeps
# the services on TCP.
ctl_sock="$rundir/controller.sock"
ctl_dial="unix:$ctl_sock"
if [ ${#ctl_sock} -gt 100 ]; then ctl_sock="" ctl_dial="127.0.0.1:$ctl"; fi
start controller "$ctl"
for ((i = 0; i < workers; i++)); do
  start "worker-$i" $((base + 3 + 10 * i)) PIE_CONTROLLER_ADDRESS="$ctl_dial" \
    PIE_WORKER_GROUP_ID="worker-$i" PIE_MODEL_PATH="$model" PIE_TP_SIZE="$tp"
  wrk_addrs+=("127.0.0.1:$((base + 3 + 10 * i))")
done
for ((i = 0; i < lifecycles; i++)); do
  # Each replica has a cache of its own and no model files, as in Kubernetes: the tokenizer
  # and programs uploaded to another replica come through the controller.
  start "lifecycle-$i" $((base + 1 + 10 * i)) PIE_CONTROLLER_ADDRESS="$ctl_dial" \
    PIE_REPLICA_ID="lifecycle-$i" PIE_RUNTIME_CACHE_DIR="$rundir/cache-$i"
  lc_addrs+=("127.0.0.1:$((base + 1 + 10 * i))")
done

# Gateways spread requests round-robin over every replica (gRPC's ipv4: list target).
gw_urls=()
lc_target="ipv4:$(IFS=,; echo "${lc_addrs[*]}")"
for ((i = 0; i < gateways; i++)); do
  start "gateway-$i" $((base + 4 + 10 * i)) PIE_LIFECYCLE_ADDRESS="$lc_target" \
    PIE_HTTP_LISTEN="127.0.0.1:$((base + 5 + 10 * i))"
  gw_urls+=("http://127.0.0.1:$((base + 5 + 10 * i))")
done

export PIE_LOCAL_RUN_DIR="$rundir" PIE_LOCAL_BIN="$bin" PIE_LOCAL_MODEL="$model" \
  PIE_LOCAL_CONTROLLER="127.0.0.1:$ctl" PIE_LOCAL_LIFECYCLES="${lc_addrs[*]}" \
  PIE_LOCAL_WORKERS="${wrk_addrs[*]}" PIE_LOCAL_GATEWAYS="${gw_urls[*]}"
for v in PIE_LOCAL_RUN_DIR PIE_LOCAL_BIN PIE_LOCAL_MODEL PIE_LOCAL_CONTROLLER PIE_LOCAL_LIFECYCLES \
  PIE_LOCAL_WORKERS PIE_LOCAL_GATEWAYS; do printf '%s=%q\n' "$v" "${!v}"; done >"$rundir/cluster.env"

echo "pie-local: $workers worker(s) of $tp rank(s), $lifecycles lifecycle replica(s), $gateways gateway(s), controller at 127.0.0.1:$ctl; logs in $rundir"
for i in "${!pids[@]}"; do echo "pie-local:   ${names[$i]} pid ${pids[$i]} at ${addrs[$i]}"; done
health_args=()
for a in "${addrs[@]}"; do health_args+=(--addr "$a"); done
ok=0
"$bin/piectl" --wait $((wait_s * 1000)) "${health_args[@]}" health || ok=1
# Registration is asynchronous: poll until the controller sees every worker and replica.
linked=0
for _ in $(seq $((wait_s * 10))); do
  out=$("$bin/piectl" --addr "127.0.0.1:$ctl" status 2>&1 || true)
  if grep -q "^workers ($workers)" <<<"$out" && grep -q "^lifecycle replicas ($lifecycles)" <<<"$out"; then
    linked=1; break
  fi
  sleep 0.1
done
[ $linked = 1 ] || { echo "pie-local: the controller did not see $workers worker(s) and $lifecycles replica(s) within $wait_s s" >&2; ok=1; }
# Each replica is ready (pie.v1.Lifecycle SERVING) once its Session knows the model and it has
# fetched the model's tokenizer: launches before that fail with UNAVAILABLE.
lc_args=()
for a in "${lc_addrs[@]}"; do lc_args+=(--addr "$a"); done
"$bin/piectl" --wait $((wait_s * 1000)) --service pie.v1.Lifecycle "${lc_args[@]}" health || ok=1
# A gateway is ready once its /readyz sees a SERVING lifecycle replica through its channel.
for u in "${gw_urls[@]}"; do
  ready=0
  for _ in $(seq $((wait_s * 10))); do
    if curl -fsS -o /dev/null "$u/readyz" 2>/dev/null; then ready=1; break; fi
    sleep 0.1
  done
  [ $ready = 1 ] || { echo "pie-local: gateway $u/readyz did not answer 200 within $wait_s s" >&2; ok=1; }
done
"$bin/piectl" --addr "127.0.0.1:$ctl" status || ok=1
if [ $check = 1 ]; then
  stop_all || ok=1
  exit $ok
fi
if [ ${#cmd[@]} -gt 0 ]; then
  if [ $ok != 0 ]; then
    echo "pie-local: the cluster did not come up; not running ${cmd[0]}" >&2
    stop_all || true
    exit 1
  fi
  st=0
  "${cmd[@]}" || st=$?
  if [ $st != 0 ] || [ $stay = 0 ]; then
    stop_all || { [ $st != 0 ] || st=1; }
    exit $st
  fi
fi
echo "pie-local: running; public API (pie.v1.Lifecycle) at ${lc_addrs[*]}${gw_urls[*]:+; OpenAI API at ${gw_urls[*]}}. Ctrl-C stops."
# Until Ctrl-C (the trap stops the rest) or until every process has ended by itself; a service
# that ends is reported and the others keep running (losing a worker fails only its instances).
while [ ${#ended[@]} -lt ${#pids[@]} ]; do
  running=()
  for i in "${!pids[@]}"; do [ -n "${ended[${pids[$i]}]+set}" ] || running+=("${pids[$i]}"); done
  done_pid="" st=0
  wait -n -p done_pid "${running[@]}" || st=$?
  [ -n "$done_pid" ] || continue
  ended[$done_pid]=$st
  for i in "${!pids[@]}"; do
    [ "${pids[$i]}" != "$done_pid" ] || echo "pie-local: ${names[$i]} (pid $done_pid) exited with status $st; see $rundir/${names[$i]}.log" >&2
  done
done
