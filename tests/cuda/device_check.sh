#!/usr/bin/env bash
# tests/cuda/device_check.sh — docs/cuda.md's GPU checks as one prepared run on a lent GPU machine.
#
# The GPU machine has nvcc, CMake, PyTorch, transformers and the CUDA profilers, but none of the
# Debian packages the build needs (gRPC, Criterion, OpenBLAS, ...), and nothing can be installed
# there. So the binaries are built HERE (tests/cuda/stage.sh packs them, their non-system shared
# libraries and the test models into .devrun/stage.tar.xz) and this script unpacks and runs them.
#
# Usage (on the GPU machine, from the repository root, .devrun carried):
#   bash tests/cuda/device_check.sh STEP...      STEP: device krn eng fault swap nccl1 gen1b gen8b bggen waitgen
#                 cmp1b cmp1b1500 cmp8b cmp8b1500 bench1b bench8b ctx1b ctx8b tf1b tf8b determ ncu1b ncu8b
#                 gemm ncupre1b ncupre8b
#                 worker workerswap swap8b memcheck initcheck racecheck
# Writes $OUT/summary.txt (one line per step: name, exit status, seconds) and $OUT/logs.tar.gz.
set -u
OUT=${OUT:-/tmp/pie-out}
mkdir -p "$OUT"
root=$PWD
st=/tmp/pie-stage/stage
logs=/tmp/pie-logs
mkdir -p "$logs" /tmp/pie-stage

if [ ! -x "$st/bin/unit_test_krn_cuda" ]; then
  tar -xJf .devrun/stage.tar.xz -C /tmp/pie-stage || { echo "cannot unpack the stage"; exit 1; }
fi
# PIE_MODELS_DIR is compiled in as the build machine's absolute path.
mdir=$(grep -aom1 '/[[:alnum:]_/.-]*/build-cuda/models' "$st/bin/unit_test_eng_cuda" || true)
[ -n "$mdir" ] && [ ! -e "$mdir" ] && mkdir -p "$(dirname "$mdir")" && ln -sfn "$st/models" "$mdir"

cublas=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -n 1)
# NCCL is not in the stage (218 MB): every binary that links the cuda engine needs this
# machine's own libnccl.so.2 (NCCL 2.28.3 in /usr/local/cuda on the H100 machine)
nccl=$(find /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local /usr/lib -name 'libnccl.so.2*' 2>/dev/null | head -n 1)
export LD_LIBRARY_PATH="$st/lib:$(dirname "${cublas:-/usr/local/cuda/lib64/x}"):$(dirname "${nccl:-/usr/local/cuda/lib64/x}"):/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
py=python3
B=$st/bin

step() {  # step NAME TIMEOUT CMD...: runs CMD under a time limit, logs it, records the result
  local name=$1 lim=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$lim" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  printf '%-12s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  grep -E "FAIL|CRASH|Synthesis|pass|rror|median|floor|graph|tok/s|ms" "$logs/$name.log" | tail -n 10 | cut -c1-220 | sed "s/^/  [$name] /"
  tar -czf "$OUT/logs.tar.gz" -C "$logs" . 2>/dev/null  # after every step: a killed run keeps its logs
}

gen() {  # gen PRESET DIR: the random bf16 model of that preset, once
  [ -f "$2/config.json" ] && return 0
  step "gen_$1" 400 $py tools/tinymodel/gen_tiny_model.py --preset "$1" --dtype bf16 --out "$2" --quiet
}
gen_pid=

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  echo "cublas: ${cublas:-not found}"; echo "nccl: ${nccl:-not found}"; } 2>&1 | tee "$OUT/summary.txt"

# docs/cuda.md step 10, first half: pie-worker with backend cuda loads, names the GPU and
# registers with a controller; piectl status shows it; SIGTERM stops both with status 0.
worker_check() {  # BIN MODEL BACKEND
  local bin=$1 model=$2 d=/tmp/pie-worker-check c w rc=0
  rm -rf "$d" && mkdir -p "$d"
  PIE_SERVER_LISTEN=127.0.0.1:50152 PIE_METRICS_LISTEN=127.0.0.1:50162 "$bin/pie-controller" \
    >"$d/controller.log" 2>&1 &
  c=$!
  PIE_SERVER_LISTEN=127.0.0.1:50153 PIE_METRICS_LISTEN=127.0.0.1:50163 \
    PIE_CONTROLLER_ADDRESS=127.0.0.1:50152 PIE_WORKER_GROUP_ID=worker-0 PIE_MODEL_PATH="$model" \
    PIE_BACKEND="$3" "$bin/pie-worker" >"$d/worker.log" 2>&1 &
  w=$!
  for _ in $(seq 100); do grep -q wrk.link.registered "$d/worker.log" && break; sleep 0.2; done
  "$bin/piectl" --addr 127.0.0.1:50152 status || rc=1
  grep -E 'wrk.loaded|wrk.link.registered|level=error' "$d/worker.log"
  kill -TERM "$w"; wait "$w" || { echo "pie-worker exited $?"; rc=1; }
  kill -TERM "$c"; wait "$c" || { echo "pie-controller exited $?"; rc=1; }
  grep -q "wrk.loaded backend=$3 .*device=\"$3: " "$d/worker.log" || { echo "no wrk.loaded with a $3 device"; rc=1; }
  grep -q wrk.link.registered "$d/worker.log" || { echo "the worker did not register"; rc=1; }
  return $rc
}
export -f worker_check

cs="compute-sanitizer --target-processes all --error-exitcode 1"
for s in "$@"; do
  case $s in
    device)    step device 60 "$B/unit_test_krn_cuda_device" --verbose ;;
    krn)       step krn 150 "$B/unit_test_krn_cuda" --verbose --short-filename ;;
    eng)       step eng 200 "$B/unit_test_eng_cuda" --verbose --short-filename ;;
    fault)     step fault 60 "$B/unit_test_eng_cuda_fault" --verbose ;;
    swap)      # issue 13: the swap policy's pinned pool, copy streams and layer events
               step swap 90 "$B/unit_test_eng_cuda_swap" --verbose --short-filename ;;
    offload)   # issue 13: offload's pinned homes, device slots, host attention per layer
               step offload 120 "$B/unit_test_eng_cuda_offload" --verbose --short-filename ;;
    workeroff) # the worker with memory.policy offload, then auto, on cuda: loads, registers
               step workeroff 60 env PIE_MEMORY_POLICY=offload PIE_MEMORY_HOST_POOL=256MiB \
                   bash -c 'worker_check "$@"' _ "$B" "$st/models/small-f32" cuda
               step workerauto 60 env PIE_MEMORY_POLICY=auto PIE_MEMORY_HOST_POOL=256MiB \
                   bash -c 'worker_check "$@"' _ "$B" "$st/models/small-f32" cuda ;;
    nccl1)     # issue 14: the engine over a one-rank NCCL communicator = the plain engine, the
               # decode graphs capturing its all-reduces, the next_dist split over 1-4 slices
               step nccl1 120 "$B/unit_test_eng_cuda_nccl" --verbose --short-filename ;;
    gen1b)     gen llama-3.2-1b /tmp/l1b ;;
    gen8b)     gen llama-3.1-8b /tmp/l8b ;;
    bggen)     { gen llama-3.2-1b /tmp/l1b; gen llama-3.1-8b /tmp/l8b; } & gen_pid=$! ;;
    waitgen)   [ -n "$gen_pid" ] && wait "$gen_pid" ;;
    cmp1b)     step cmp1b 240 $py tests/cuda/compare_transformers.py --runner "$B/pie-cuda-run" \
                   --model /tmp/l1b --prompt-len 64 --greedy 32 ;;
    cmp1b1500) step cmp1b1500 240 $py tests/cuda/compare_transformers.py --runner "$B/pie-cuda-run" \
                   --model /tmp/l1b --prompt-len 1500 --greedy 32 ;;
    cmp8b)     step cmp8b 300 $py tests/cuda/compare_transformers.py --runner "$B/pie-cuda-run" \
                   --model /tmp/l8b --prompt-len 64 --greedy 16 ;;
    cmp8b1500) step cmp8b1500 300 $py tests/cuda/compare_transformers.py --runner "$B/pie-cuda-run" \
                   --model /tmp/l8b --prompt-len 1500 --greedy 16 ;;
    bench1b)   step bench1b 120 "$B/bench_cuda" /tmp/l1b --context 1024 --batch 64 --prefill 2048 --steps 32
               step bench1b_b1 120 "$B/bench_cuda" /tmp/l1b --context 1024 --batch 1 --prefill 64 --steps 32 ;;
    off8b)     # issue 13: offload on the 8B shape at 4k context beside the same run on the device:
               # b=64 with 0, 8 and 16 sequences' attention on 12 host threads (Neo's sub-batch 1)
               for h in 0 8 16; do
                 step off8b_h$h 150 "$B/bench_cuda" /tmp/l8b --context 4096 --batch 64 --prefill 64 \
                     --steps 8 $( [ $h -gt 0 ] && echo --offload-host $h --offload-threads 12 )
               done ;;
    swap8b)    # issue 13: the swap policy on the 8B shape beside bench8b's gpu rows: b=1 with
               # half the layers on the host (transparency), b=64 with 4 of 32 there (its stalls)
               step swap8b_b1 120 "$B/bench_cuda" /tmp/l8b --context 1024 --batch 1 --prefill 64 \
                   --steps 32 --decode-only --swap-slots 16
               step swap8b 180 "$B/bench_cuda" /tmp/l8b --context 1024 --batch 64 --prefill 2048 \
                   --steps 16 --swap-slots 28 ;;
    bench8b)   step bench8b 180 "$B/bench_cuda" /tmp/l8b --context 1024 --batch 64 --prefill 2048 --steps 32
               step bench8b_b1 120 "$B/bench_cuda" /tmp/l8b --context 1024 --batch 1 --prefill 64 --steps 32 ;;
    ctx8b)     # docs/cuda.md: 8B batch-1 decode against the read floor at long contexts
               step ctx8b_8k 150 "$B/bench_cuda" /tmp/l8b --context 8192 --batch 1 --decode-only --steps 16
               step ctx8b_32k 200 "$B/bench_cuda" /tmp/l8b --context 32768 --batch 1 --decode-only --steps 16 ;;
    ctx1b)     step ctx1b_8k 100 "$B/bench_cuda" /tmp/l1b --context 8192 --batch 1 --decode-only --steps 16
               step ctx1b_32k 120 "$B/bench_cuda" /tmp/l1b --context 32768 --batch 1 --decode-only --steps 16 ;;
    tf1b|tf8b) m=/tmp/l${s#tf}  # transformers on the shapes of bench1b/bench8b (decode b=64, prefill 2048)
               step "$s" 300 $py bench/cuda/bench_transformers.py --model "$m" --context 1024 --batch 64 \
                   --prefill 2048 --steps 8 ;;
    determ)    toks=$(seq -s, 1 37 3000)  # fresh processes, graphs on, off, on: identical JSON
               step determ 120 bash -c "set -e; for i in 1 2 3; do f=; [ \$i = 2 ] && f=--no-graphs; \
                   '$B/pie-cuda-run' --model /tmp/l1b --tokens $toks --greedy 16 \$f >$logs/determ_\$i.json; \
                   done; cmp $logs/determ_1.json $logs/determ_2.json; cmp $logs/determ_1.json $logs/determ_3.json" ;;
    ncu1b|ncu8b) m=/tmp/l${s#ncu}  # per-kernel GPU time of a short b=1 run (nsys is not installed)
               step "$s" 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
                   --print-summary per-kernel "$B/bench_cuda" "$m" --decode-only --batch 1 \
                   --steps 2 --bw-mib 64 ;;
    gemm)      # cuBLAS at the engine's linear shapes, f32 vs bf16 output (prefill's 0.60x of transformers)
               step gemm 60 "$B/bench_gemm" --shape 8b
               step gemm1b 60 "$B/bench_gemm" --shape 1b ;;
    ncupre1b|ncupre8b) m=/tmp/l${s#ncupre}  # per-kernel GPU time of prefill 2048 (two forwards)
               step "$s" 400 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
                   --print-summary per-kernel "$B/bench_cuda" "$m" --batch 1 --context 64 \
                   --prefill 2048 --steps 1 --bw-mib 64 ;;
    worker)    step worker 60 bash -c 'worker_check "$@"' _ "$B" "$st/models/small-f32" "${PIE_CHECK_BACKEND:-cuda}" ;;
    workerswap) # the worker with memory.policy swap on cuda (fixed, then adaptive): loads,
               # registers, serves Info
               step workerswap 60 env PIE_MEMORY_POLICY=swap PIE_MEMORY_DEVICE_LAYERS=2 \
                   PIE_MEMORY_HOST_POOL=256MiB bash -c 'worker_check "$@"' _ "$B" \
                   "$st/models/small-f32" cuda
               step workerswap_adaptive 60 env PIE_MEMORY_POLICY=swap \
                   PIE_MEMORY_HOST_POOL=256MiB bash -c 'worker_check "$@"' _ "$B" \
                   "$st/models/small-f32" cuda ;;
    memcheck)  step memcheck_krn 240 $cs --tool memcheck "$B/unit_test_krn_cuda" -j1
               step memcheck_eng 300 $cs --tool memcheck "$B/unit_test_eng_cuda" -j1 \
                   --filter '!(*device_fault*)' ;;
    initcheck) step initcheck_krn 240 $cs --tool initcheck "$B/unit_test_krn_cuda" -j1
               # graphs off: the tests of graph replay itself are left out (they assert replays)
               step initcheck_eng 300 env PIE_CUDA_GRAPHS=0 $cs --tool initcheck "$B/unit_test_eng_cuda" -j1 \
                   --filter '!(*device_fault*|*graphs*)'
               step memcheck_eng_nographs 300 env PIE_CUDA_GRAPHS=0 $cs --tool memcheck \
                   "$B/unit_test_eng_cuda" -j1 --filter '!(*device_fault*|*graphs*)' ;;
    racecheck) step racecheck_krn 240 $cs --tool racecheck "$B/unit_test_krn_cuda" -j1
               step synccheck_krn 240 $cs --tool synccheck "$B/unit_test_krn_cuda" -j1 ;;
    *) echo "unknown step $s" ;;
  esac
done
tar -czf "$OUT/logs.tar.gz" -C "$logs" . 2>/dev/null
cat "$OUT/summary.txt"
