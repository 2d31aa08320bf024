#!/usr/bin/env bash
# bench/peers/run.sh — Pie-C's CPU engine side by side with llama.cpp on the same weights.
#
# Owns: the peer comparison's procedure: the models (gen_tiny_model.py presets, in bf16 and f32),
# their GGUF conversion (tools/gguf/hf_to_gguf.py), the correctness gate before any timing
# (verify.mjs on a small f32 model: llama.cpp's next-token distributions == the engine's), and
# interleaved rounds of bench/engine/bench_engine (Pie-C) and llama_bench.mjs (llama.cpp through
# node-llama-cpp) doing the same work, summarised by summarize.py as per-round tok/s and the
# Pie-C / llama.cpp ratio (min / median / max over the rounds).
# Does not own: what each measurement is (bench_engine.c's and llama_bench.mjs's header
# comments), installing node-llama-cpp (setup.sh), recording (bench/run.sh peers appends this
# script's output, with the commit, CPU, load and processes, to bench/results/peers.md).
#
# Usage: bench/peers/run.sh [--models DIR] [--build-dir DIR] [--no-build] [--out DIR]
#            [--rounds 3] [--shapes 1b,8b] [--dtypes bf16,f32] [--sequences 1,8,32]
#            [--prefill 128,512] [--context 512] [--steps 8] [--threads 2] [--pie-kv f32|bf16]
#            [--no-verify] [--quick] [--warmup 1]
#   --models     generated models and their .gguf files (default /tmp/pie-bench-models;
#                llama1b-bf16 is the one bench/run.sh engine uses)
#   --build-dir  build with bench_engine and pie-engine-probe (default build-bench, configured
#                Release and built unless --no-build)
#   --out        raw outputs of every run (default /tmp/pie-peers-<UTC time>)
#   --shapes     1b = gen_tiny_model.py --preset llama-3.2-1b, 8b = --preset llama-3.1-8b; a shape
#                whose weights + the engine's f32 KV cache + 1.5 GiB do not fit in MemAvailable
#                (or whose model + GGUF do not fit on the models' disk) is skipped with a note
#   --sequences  decode batch sizes, each at --context tokens of context (1 = single sequence)
#   --prefill    prompt lengths prefilled in one forward
#   --pie-kv     what Pie-C's KV pool stores (bench_engine --kv; engine.kv_dtype): f32 (default)
#                or bf16 (llama.cpp's default KV cache is F16: the same bytes per value)
#   --quick      one round, 1b bf16, sequences 1, prefill 128, 2 steps: a smoke run
#   --warmup     untimed rounds of both engines before the measured ones (default 1; 0: none):
#                the first process after this kind of VM sat idle ran at a third of its speed
#                (bench/results/peers.md, 2026-11-30); kept in the output folder as w<N>-*.txt
# Each round runs both engines one after the other (Pie-C first in odd rounds, llama.cpp first in
# even ones), 2 threads each by default; the machine's load average is printed before each run.
# Needs bench/peers/node_modules (bench/peers/setup.sh). Never run in CI.
# shellcheck disable=SC2086  # option lists are word lists by construction
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

models=/tmp/pie-bench-models build_dir=build-bench do_build=1 out="" rounds=3 warmup=1 shapes=1b,8b
dtypes=bf16,f32 sequences=1,8,32 prefill=128,512 context=512 steps=8 threads=2 verify=1 pie_kv=f32
usage() { sed -n '/^# Usage:/,/^# shellcheck/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --models) models=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --out) out=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --shapes) shapes=$2; shift 2 ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --sequences) sequences=$2; shift 2 ;;
    --prefill) prefill=$2; shift 2 ;;
    --context) context=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --pie-kv) pie_kv=$2; shift 2 ;;
    --no-verify) verify=0; shift ;;
    --warmup) warmup=$2; shift 2 ;;
    --quick) rounds=1 warmup=0 shapes=1b dtypes=bf16 sequences=1 prefill=128 steps=2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench/peers/run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$rounds$warmup" in ''|*[!0-9]*) echo "bench/peers/run.sh: --rounds and --warmup take a count" >&2; exit 2 ;; esac
out=${out:-/tmp/pie-peers-$(date -u +%Y%m%dT%H%M%SZ)}
say() { echo "peers: $*" >&2; }
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

if [ ! -d "$here/node_modules/node-llama-cpp" ]; then
  say "node-llama-cpp is not installed: run bench/peers/setup.sh first"
  exit 2
fi
if [ $do_build = 1 ]; then
  [ -f "$build_dir/CMakeCache.txt" ] ||
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DPIE_CUDA=OFF >&2
  cmake --build "$build_dir" -j"$(nproc)" --target bench_engine pie-engine-probe >&2
fi
bench_engine=$build_dir/bench/bench_engine probe=$build_dir/bin/pie-engine-probe
mkdir -p "$out" "$models"

# ---- the correctness gate: the converter on a small f32 model --------------------------------
if [ $verify = 1 ]; then
  small=$models/peers-small-f32
  [ -f "$small/config.json" ] ||
    /usr/bin/python3 tools/tinymodel/gen_tiny_model.py --preset small --dtype f32 --out "$small" --quiet
  /usr/bin/python3 tools/gguf/hf_to_gguf.py "$small" --out "$small.gguf" --quiet
  echo "## Conversion check: $small (llama.cpp f32, KV cache F32, no flash attention)"
  echo
  node "$here/verify.mjs" --gguf "$small.gguf" --model "$small" --probe "$probe" --threads "$threads"
  echo
fi

# ---- models ------------------------------------------------------------------------------------
preset_of() { case "$1" in 1b) echo llama-3.2-1b ;; 8b) echo llama-3.1-8b ;; *) return 1 ;; esac; }
# parameters (millions), and f32 KV bytes per token (layers * 2 * kv_heads * head_dim * 4)
params_m_of() { case "$1" in 1b) echo 1236 ;; 8b) echo 8030 ;; esac; }
kv_token_bytes_of() { case "$1" in 1b) echo $((16 * 2 * 8 * 64 * 4)) ;; 8b) echo $((32 * 2 * 8 * 128 * 4)) ;; esac; }
elt_of() { case "$1" in f32) echo 4 ;; *) echo 2 ;; esac; }
max_seq=$(tr ',' '\n' <<<"$sequences" | sort -n | tail -1)

# "ok", or why the shape cannot run here.
fits() {
  local shape=$1 dtype=$2 weights kv need avail disk
  weights=$(( $(params_m_of "$shape") * 1000000 * $(elt_of "$dtype") ))
  kv=$(( $(kv_token_bytes_of "$shape") * (max_seq * (context + steps + 16) + ${prefill##*,}) ))
  need=$(( weights + kv + 1536 * 1048576 ))
  avail=$(( $(awk '/^MemAvailable/ { print $2 }' /proc/meminfo) * 1024 ))
  disk=$(( $(df -Pk "$models" | awk 'NR == 2 { print $4 }') * 1024 ))
  if [ "$need" -gt "$avail" ]; then
    printf 'needs %.1f GiB of memory (weights %.1f + f32 KV for %s sequences %.1f + 1.5), %.1f GiB available\n' \
      "$(awk "BEGIN { print $need / 2^30 }")" "$(awk "BEGIN { print $weights / 2^30 }")" "$max_seq" "$(awk "BEGIN { print $kv / 2^30 }")" \
      "$(awk "BEGIN { print $avail / 2^30 }")"
  elif [ ! -f "$models/llama$shape-$dtype.gguf" ] && [ "$((2 * weights))" -gt "$disk" ]; then
    printf 'needs %.1f GiB of disk under %s (model + GGUF), %.1f GiB free\n' \
      "$(awk "BEGIN { print 2 * $weights / 2^30 }")" "$models" "$(awk "BEGIN { print $disk / 2^30 }")"
  else echo ok; fi
}

prepare() { # the model directory and its GGUF, each made when missing or older than its source
  local shape=$1 dtype=$2 dir=$models/llama$1-$2
  if [ ! -f "$dir/config.json" ]; then
    say "generating $dir"
    /usr/bin/python3 tools/tinymodel/gen_tiny_model.py --preset "$(preset_of "$shape")" --dtype "$dtype" --out "$dir" --quiet
  fi
  if [ ! -f "$dir.gguf" ] || [ -n "$(find "$dir" -newer "$dir.gguf" -name '*.safetensors' | head -1)" ]; then
    say "converting $dir to $dir.gguf"
    /usr/bin/python3 tools/gguf/hf_to_gguf.py "$dir" --out "$dir.gguf" --quiet
  fi
}

# r<N> for a measured round (summarize.py reads r*-*.txt), w<N> as it is for a warm-up round
round_file() { case "$1" in w*) echo "$1" ;; *) echo "r$1" ;; esac; }

# ---- one side of a round ---------------------------------------------------------------------
# Pie-C: bench_engine measures b=1 decode, one b=B decode and one prefill per run, so the
# sequence counts above 1 and the prefill lengths are paired into as few runs as possible.
pie_runs() {
  local -a bs ps
  IFS=, read -ra bs <<<"$sequences"
  IFS=, read -ra ps <<<"$prefill"
  local -a big=()
  for b in "${bs[@]}"; do [ "$b" != 1 ] && big+=("$b"); done
  [ ${#big[@]} -gt 0 ] || big=(1)
  local n=${#big[@]} i
  [ ${#ps[@]} -gt "$n" ] && n=${#ps[@]}
  for ((i = 0; i < n; i++)); do
    local b=${big[i]:-1} p=${ps[i]:-}
    if [ -n "$p" ]; then echo "--batch $b --prefill $p"; else echo "--batch $b --skip-prefill"; fi
  done
}

run_pie() { # round: a number, or w<N> for a warm-up round
  local dir=$1 round=$2 i=0
  while read -r opts; do
    local c="$bench_engine $dir --threads $threads --context $context --steps $steps --bw-mib 512 --kv $pie_kv $opts"
    say "round $round: Pie-C: $c (load $(loadavg))"
    echo "# load average before: $(loadavg); command: $c" >"$out/$(basename "$dir")/$(round_file "$round")-pie-$i.txt"
    $c >>"$out/$(basename "$dir")/$(round_file "$round")-pie-$i.txt"
    i=$((i + 1))
  done < <(pie_runs)
}

run_llama() {
  local dir=$1 round=$2
  local c="node $here/llama_bench.mjs --gguf $dir.gguf --threads $threads --context $context --sequences $sequences --prefill $prefill --steps $steps"
  say "round $round: llama.cpp: $c (load $(loadavg))"
  echo "# load average before: $(loadavg); command: $c" >"$out/$(basename "$dir")/$(round_file "$round")-llama.txt"
  $c >>"$out/$(basename "$dir")/$(round_file "$round")-llama.txt"
}

# ---- main --------------------------------------------------------------------------------------
echo "Pie-C vs llama.cpp: shapes $shapes, dtypes $dtypes, sequences $sequences @ $context context, prefill $prefill, $steps decode steps, $threads threads, $rounds rounds after $warmup warm-up, Pie-C KV cache $pie_kv${PIE_KRN_AMX:+, PIE_KRN_AMX=$PIE_KRN_AMX}; raw outputs in $out"
echo
for shape in ${shapes//,/ }; do
  preset_of "$shape" >/dev/null || { say "unknown shape $shape (1b or 8b)"; exit 2; }
  for dtype in ${dtypes//,/ }; do
    name=llama$shape-$dtype
    why=$(fits "$shape" "$dtype")
    if [ "$why" != ok ]; then
      echo "## $name ($(preset_of "$shape"), $dtype): skipped: $why"
      echo
      continue
    fi
    prepare "$shape" "$dtype"
    mkdir -p "$out/$name"
    for ((r = 1; r <= warmup; r++)); do run_pie "$models/$name" "w$r"; run_llama "$models/$name" "w$r"; done
    for ((r = 1; r <= rounds; r++)); do
      if [ $((r % 2)) = 1 ]; then run_pie "$models/$name" $r; run_llama "$models/$name" $r
      else run_llama "$models/$name" $r; run_pie "$models/$name" $r; fi
    done
    echo "## $name ($(preset_of "$shape"), $dtype; load average now $(loadavg))"
    echo
    /usr/bin/python3 "$here/summarize.py" "$out/$name"
    echo
  done
done
