#!/usr/bin/env bash
# bench/run.sh — runs the benchmarks of bench/ and appends each one's results, with their
# provenance, to bench/results/<name>.md.
#
# Owns: the documented command of every benchmark (full and --quick), the build they run from,
# and the record: one dated section per benchmark and run, headed by the commit (+dirty when the
# tree has changes outside bench/results), the CPU model and core count, memory, kernel, build
# directory and type, then per command the load average before and after, the wall time, the
# exit status, the exact command and its whole output.
# Does not own: what a benchmark measures (bench/*/bench_*.c, their header comments) or the
# discussion of results (written by hand above the recorded sections of each results file).
#
# Usage: bench/run.sh [--quick] [--build-dir DIR] [--no-build] [--models DIR] [--no-record]
#                     [--dry-run] [--list] [BENCH...]
#   BENCH       rpc tok kernels engine worker controller wasm lifecycle gateway tp cuda peers (default:
#               all but cuda and peers, which run only when named: cuda needs an NVIDIA GPU, peers
#               llama.cpp from bench/peers/setup.sh and an hour or more on 2 cores)
#   --quick     the short form of each benchmark (a smoke run: seconds to a minute each)
#   --build-dir the build to use (default build-bench: Release, -DPIE_CUDA=OFF; build-bench-cuda
#               with -DPIE_CUDA=ON for cuda); configured and built (only the targets needed)
#               unless --no-build
#   --models    where generated benchmark models are kept (default /tmp/pie-bench-models):
#               engine uses the llama-3.2-1b preset (2.5 GB in bf16), cuda also llama-3.1-8b;
#               peers makes its own there (bench/peers/run.sh: 1b and 8b, bf16 and f32, + GGUF)
#   --no-record print the results, append nothing
#   --dry-run   print the commands, run nothing
# shellcheck disable=SC2317,SC2016,SC2086  # cmds_* are called by name; backticks are Markdown; $quick is 0 or 1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

all=(rpc tok kernels engine worker controller wasm lifecycle gateway tp)
quick=0 build_dir="" do_build=1 models=/tmp/pie-bench-models record=1 dry=0 sel=()
invocation="bench/run.sh${*:+ $*}"
usage() { sed -n '/^# Usage:/,/^# shellcheck/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --models) models=$2; shift 2 ;;
    --no-record) record=0; shift ;;
    --dry-run) dry=1; shift ;;
    --list) printf '%s\n' "${all[@]}" cuda peers; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "bench/run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) case " ${all[*]} cuda peers " in *" $1 "*) sel+=("$1") ;;
         *) echo "bench/run.sh: unknown benchmark '$1' (known: ${all[*]} cuda peers)" >&2; exit 2 ;;
       esac; shift ;;
  esac
done
[ ${#sel[@]} -gt 0 ] || sel=("${all[@]}")

want_cuda=0
for b in "${sel[@]}"; do [ "$b" = cuda ] && want_cuda=1; done
if [ $want_cuda = 1 ] && [ $dry = 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/run.sh: cuda needs an NVIDIA GPU (nvidia-smi -L finds none); run the others without it" >&2
  exit 2
fi
if [ -z "$build_dir" ]; then
  build_dir=build-bench
  [ $want_cuda = 1 ] && build_dir=build-bench-cuda
fi
B=$build_dir # as the commands are recorded: relative to the repository root when given so

# ---- the commands ------------------------------------------------------------------------------
# cmds_<bench>: one command per line, as run from the repository root ($B = the build directory,
# $M = the models directory). The full forms are the ones the results files document.
cmds_rpc() { if [ $quick = 1 ]; then echo "$B/bench/bench_rpc --quick"; else echo "$B/bench/bench_rpc"; fi; }
cmds_tok() { if [ $quick = 1 ]; then echo "$B/bench/bench_tok --quick"; else echo "$B/bench/bench_tok"; fi; }
cmds_kernels() { if [ $quick = 1 ]; then echo "$B/bench/bench_krn --quick"; else echo "$B/bench/bench_krn"; fi; }
cmds_engine() {
  if [ $quick = 1 ]; then echo "$B/bench/bench_engine $models/llama1b-bf16 --steps 2 --bw-mib 512"
  else echo "$B/bench/bench_engine $models/llama1b-bf16 --steps 8"; fi
}
cmds_worker() {
  if [ $quick = 1 ]; then
    echo "$B/bench/bench_worker_link --backend null --instances 1,32,256 --steps 200"
    echo "$B/bench/bench_worker_link --backend cpu --model $B/models/tiny-f32 --instances 1,32 --steps 100"
  else
    echo "$B/bench/bench_worker_link --backend null"
    echo "$B/bench/bench_worker_link --backend null --k 1"
    echo "$B/bench/bench_worker_link --backend cpu --model $B/models/tiny-f32 --instances 1,32 --steps 1000"
  fi
}
cmds_controller() {
  if [ $quick = 1 ]; then echo "$B/bench/bench_controller --quick"; else echo "$B/bench/bench_controller"; fi
}
cmds_wasm() {
  if [ $quick = 1 ]; then echo "$B/bench/bench_wasm --cold 5 --warm 200 --calls 1000000 --instances 64 --tier1 0"
  else echo "$B/bench/bench_wasm"; fi
}
cmds_lifecycle() {
  if [ $quick = 1 ]; then echo "$B/bench/bench_lifecycle --quick"
  else echo "$B/bench/bench_lifecycle"; echo "$B/bench/bench_lifecycle --serving"; fi
}
cmds_gateway() { # inside a local cluster (1 worker, 1 lifecycle replica, 1 gateway)
  local cluster="bash deploy/local/pie-local.sh --bin $B/bin --base-port random --exec"
  if [ $quick = 1 ]; then echo "$cluster $B/bench/bench_gateway --tokens 32 --rounds 5 --concurrency 32"
  else echo "$cluster $B/bench/bench_gateway --tokens 64 --rounds 30 --concurrency 256 --load-tokens 16 --load-requests 2"; fi
}
cmds_tp() { # the host collective, then the sharded cpu engine at tp 1 and 2 (bench/results/tp.md)
  if [ $quick = 1 ]; then
    echo "$B/bench/bench_tp coll --quick"
    echo "$B/bench/bench_tp coll --tcp --quick"
    echo "$B/bench/bench_tp engine $models/llama1b-bf16 --tp 1,2 --prefill 32 --context 64 --batch 4 --steps 2 --rounds 1"
  else
    echo "$B/bench/bench_tp coll"
    echo "$B/bench/bench_tp coll --tcp"
    echo "$B/bench/bench_tp engine $models/llama1b-bf16 --tp 1,2 --prefill 128 --context 256 --batch 8 --steps 8"
  fi
}
cmds_cuda() {
  if [ $quick = 1 ]; then
    echo "$B/bench/bench_cuda $models/l1b --context 1024 --batch 64 --prefill 2048 --steps 8"
  else
    echo "$B/bench/bench_cuda $models/l8b --context 1024 --batch 64 --prefill 2048 --steps 32"
    echo "$B/bench/bench_cuda $models/l1b --context 1024 --batch 64 --prefill 2048 --steps 32"
    echo "$B/bench/bench_cuda $models/l8b --context 1024 --batch 64 --prefill 2048 --steps 32 --no-graphs"
    echo "/usr/bin/python3 bench/cuda/bench_transformers.py --model $models/l8b --context 1024 --batch 64 --prefill 2048"
    echo "/usr/bin/python3 bench/cuda/bench_transformers.py --model $models/l1b --context 1024 --batch 64 --prefill 2048"
  fi
}
cmds_peers() { # Pie-C against llama.cpp (bench/peers/README.md); it makes its own models and GGUF
  if [ $quick = 1 ]; then echo "bench/peers/run.sh --build-dir $B --models $models --no-build --quick"
  else echo "bench/peers/run.sh --build-dir $B --models $models --no-build"; fi
}
# Build targets and generated models each benchmark needs.
targets_of() {
  case "$1" in
    rpc) echo bench_rpc ;;
    tok) echo bench_tok ;;
    kernels) echo bench_krn ;;
    engine) echo bench_engine ;;
    worker) echo bench_worker_link pie-worker pie_test_models ;;
    controller) echo bench_controller pie-controller pie-worker pie_test_models ;;
    wasm) echo bench_wasm ;;
    lifecycle) echo bench_lifecycle pie-controller pie-worker pie-lifecycle pie_test_models inferlet_text_completion ;;
    gateway) echo bench_gateway pie-controller pie-worker pie-lifecycle pie-gateway piectl pie_test_models inferlet_openai_chat ;;
    tp) echo bench_tp ;;
    cuda) echo bench_cuda ;;
    peers) echo bench_engine pie-engine-probe ;;
  esac
}
models_of() {
  case "$1" in
    engine|tp) echo "llama1b-bf16:llama-3.2-1b" ;;
    cuda) if [ $quick = 1 ]; then echo "l1b:llama-3.2-1b"; else echo "l1b:llama-3.2-1b l8b:llama-3.1-8b"; fi ;;
  esac
}

# ---- provenance --------------------------------------------------------------------------------
commit() {
  local c changed
  c=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  # Changes outside bench/results (where this script itself writes) make the tree dirty.
  changed=$(git status --porcelain --untracked-files=no -- . ':(exclude)bench/results' 2>/dev/null | wc -l)
  if [ "$changed" -gt 0 ]; then echo "$c+dirty ($changed tracked files modified)"; else echo "$c"; fi
}
cpu_model() { lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1; }
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
# The processes using CPU right now (top's second sample, over one second), this script aside.
busy_procs() {
  top -b -n 2 -d 1 -w 200 2>/dev/null | awk '
    /^top -/ { frame++ } frame == 2 && started && $9 + 0 >= 10 { printf "%s%s %s%%", sep, $12, $9; sep = ", "; n++ }
    frame == 2 && $1 == "PID" { started = 1 } END { if (!n) printf "none above 10%%" }'
}
build_desc() {
  local cache=$build_dir/CMakeCache.txt type cuda cc
  type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$cache" 2>/dev/null)
  cuda=$(sed -n 's/^PIE_CUDA:[A-Z]*=//p' "$cache" 2>/dev/null)
  cc=$(sed -n 's/^CMAKE_C_COMPILER:[A-Z]*=//p' "$cache" 2>/dev/null)
  cc=$("${cc:-cc}" --version 2>/dev/null | head -1)
  echo "\`$build_dir\`, ${type:-default build type}, PIE_CUDA=${cuda:-default}, $cc"
}

# ---- build and models --------------------------------------------------------------------------
run_or_echo() { if [ $dry = 1 ]; then echo "+ $*"; else "$@"; fi; }
if [ $do_build = 1 ]; then
  if [ ! -f "$build_dir/CMakeCache.txt" ]; then
    cuda_opt=-DPIE_CUDA=OFF
    [ $want_cuda = 1 ] && cuda_opt=-DPIE_CUDA=ON
    run_or_echo cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "$cuda_opt"
  fi
  targets=()
  for b in "${sel[@]}"; do read -ra t <<<"$(targets_of "$b")"; targets+=("${t[@]}"); done
  mapfile -t targets < <(printf '%s\n' "${targets[@]}" | awk '!seen[$0]++')
  run_or_echo cmake --build "$build_dir" -j"$(nproc)" --target "${targets[@]}"
fi
for b in "${sel[@]}"; do
  for m in $(models_of "$b"); do
    dir=$models/${m%%:*} preset=${m#*:}
    [ -f "$dir/config.json" ] && continue
    run_or_echo /usr/bin/python3 tools/tinymodel/gen_tiny_model.py --preset "$preset" --dtype bf16 --out "$dir"
  done
done

# ---- run and record ----------------------------------------------------------------------------
started=$(date -u '+%Y-%m-%d %H:%M UTC')
rev=$(commit)
cpu="$(cpu_model), $(nproc) cores online (nproc)"
mem=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
kernel=$(uname -r)
gpu=""
if [ $want_cuda = 1 ]; then
  gpu="$(nvidia-smi -L 2>/dev/null | head -4 | paste -sd';' -); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1); $(/usr/local/cuda/bin/nvcc --version 2>/dev/null | tail -1)"
fi
bdesc=$(build_desc)
rc_all=0
for b in "${sel[@]}"; do
  mapfile -t cmds < <("cmds_$b")
  if [ $dry = 1 ]; then printf '+ %s\n' "${cmds[@]}"; continue; fi
  sec=$(mktemp)
  {
    echo
    echo "## Run of $started: \`$invocation\`"
    echo
    echo "Recorded by \`bench/run.sh\`$([ $quick = 1 ] && echo ' with `--quick` (a smoke run: fewer repetitions than the numbers above)')."
    echo
    echo "| | |"
    echo "| --- | --- |"
    echo "| commit | \`$rev\` |"
    echo "| CPU | $cpu |"
    [ -n "$gpu" ] && echo "| GPU | $gpu |"
    echo "| memory, kernel | $mem, Linux $kernel |"
    echo "| build | $bdesc |"
  } >"$sec"
  first=1
  for c in "${cmds[@]}"; do
    la0=$(loadavg)
    busy=$(busy_procs)
    out=$(mktemp)
    echo "bench/run.sh: $b: $c" >&2
    t0=$(date +%s.%N)
    st=0
    # shellcheck disable=SC2086 # the command is a word list by construction
    $c 2>&1 | tee "$out" || st=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    la1=$(loadavg)
    busy1=$(busy_procs)
    [ "$st" = 0 ] || rc_all=1
    {
      if [ $first = 1 ]; then
        echo "| load average (1, 5, 15 min) before the first command | $la0 |"
        echo "| processes using ≥ 10% of a core at the start | $busy |"
        first=0
      fi
      echo
      echo "**Command:** \`$c\` — load average before: $la0, after: $la1; $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s; exit status $st."
      # More runnable work than cores at either end: say that the machine was shared.
      # Other processes busy just before or just after it: the machine was shared.
      if [ "${busy%% *}" != none ] || [ "${busy1%% *}" != none ]; then
        echo "**The machine was shared with other work** (busy in the second before: $busy; in the second after: $busy1; 1-minute load average ${la0%% *} before, ${la1%% *} after, on $(nproc) cores): times are inflated and vary."
      elif awk -v l0="${la0%% *}" -v n="$(nproc)" 'BEGIN { exit !(l0 >= n / 2) }'; then
        echo "The 1-minute load average was ${la0%% *} on $(nproc) cores at the start, but no other process was busy just before or after: the average counts work that had just ended (a build, the previous command)."
      fi
      echo
      echo '```text'
      cat "$out"
      echo '```'
    } >>"$sec"
    rm -f "$out"
  done
  if [ $record = 1 ]; then
    cat "$sec" >>"bench/results/$b.md"
    echo "bench/run.sh: appended a section to bench/results/$b.md" >&2
  else
    cat "$sec"
  fi
  rm -f "$sec"
done
exit $rc_all
