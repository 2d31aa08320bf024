#!/usr/bin/env bash
# tests/fuzz/run.sh — builds the libFuzzer harnesses (clang, ASan+UBSan; build-fuzz/) and runs
# them. README.md here says what each harness covers.
#
#   tests/fuzz/run.sh --smoke                 every harness: its seed corpus, then a few seconds
#                                             of fuzzing (CI; about 60 s in all on 2 cores)
#   tests/fuzz/run.sh --long SECONDS [T...]   fuzz each harness (or the targets T) for SECONDS,
#   tests/fuzz/run.sh --runs N [T...]         or N executions (both: whichever comes first)
#   tests/fuzz/run.sh --list                  the targets
#
# Harnesses run one after another, one process each (never -jobs/-workers). Long runs keep
# their growing corpus in build-fuzz/fuzz-corpus/<target> (seeded from corpus/<target>), logs in
# build-fuzz/fuzz-logs/<target>.log and findings (crash-*, leak-*, timeout-*) in
# build-fuzz/fuzz-artifacts/<target>/. Exit status: 0 when no harness found anything, 77 when
# clang's libFuzzer is not installed (nothing ran; under CI=true that is a failure, 1).
# Environment: PIE_FUZZ_BUILD (default build-fuzz), PIE_FUZZ_JOBS (build parallelism, 2).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${PIE_FUZZ_BUILD:-$root/build-fuzz}
jobs=${PIE_FUZZ_JOBS:-2}
targets=()
for f in "$here"/fuzz_*.c; do
  t=$(basename "$f" .c)
  t=${t#fuzz_}
  [ -d "$here/corpus/$t" ] && targets+=("$t") # harnesses have a corpus; helpers do not
done

mode="" seconds=0 runs=0
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) mode=smoke ;;
    --long) mode=long; seconds=${2:?--long needs SECONDS}; shift ;;
    --runs) mode=long; runs=${2:?--runs needs N}; shift ;;
    --list) printf '%s\n' "${targets[@]}"; exit 0 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ -n "$mode" ] || { echo "usage: tests/fuzz/run.sh --smoke | --long SECONDS | --runs N [targets]" >&2; exit 2; }
[ $# -gt 0 ] && targets=("$@")

# Without clang's libFuzzer there is nothing to build: a visible skip (exit 77), not a failure.
if ! command -v clang >/dev/null ||
   ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' |
     clang -x c -fsanitize=fuzzer -o /dev/null - 2>/dev/null; then
  # CI=true: tools/setup.sh installs clang and libclang-rt-14-dev, so a missing one is a failure
  [ "${CI:-}" = true ] && { echo "fuzz: clang with libFuzzer (libclang-rt-dev) not found"; exit 1; }
  echo "fuzz: skipped: clang with libFuzzer (libclang-rt-dev) not found"
  exit 77
fi

t0=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  mkdir -p "$build" # its log inside it, not beside it in the source tree
  cmake -S "$root" -B "$build" -DCMAKE_C_COMPILER=clang -DPIE_FUZZ=ON -DPIE_CUDA=OFF \
    -DPIE_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; echo "fuzz: configure failed"; exit 1; }
fi
if ! cmake --build "$build" --target fuzz_all -j"$jobs" >"$build/fuzz-build.log" 2>&1; then
  grep -E 'error|Error' "$build/fuzz-build.log" | head -30
  echo "fuzz: build failed (see $build/fuzz-build.log)"
  exit 1
fi
t1=$(date +%s)
echo "fuzz: built in $((t1 - t0)) s"

# Smoke: a share of 60 s each, less a second for start-up and the corpus pass.
per=$(( 60 / ${#targets[@]} - 1 ))
[ "$per" -ge 1 ] || per=1
failed=0
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for t in "${targets[@]}"; do
  exe=$build/fuzz/fuzz_$t
  [ -x "$exe" ] || { echo "fuzz: no harness $t"; failed=$((failed + 1)); continue; }
  art=$build/fuzz-artifacts/$t
  mkdir -p "$art" "$build/fuzz-logs"
  if [ "$mode" = smoke ]; then
    work=$(mktemp -d)
    args=(-max_total_time="$per" -timeout=10 "$work" "$here/corpus/$t")
  else
    work=$build/fuzz-corpus/$t
    mkdir -p "$work"
    args=("$work" "$here/corpus/$t")
    [ "$seconds" -gt 0 ] && args=(-max_total_time="$seconds" "${args[@]}")
    [ "$runs" -gt 0 ] && args=(-runs="$runs" "${args[@]}")
    args=(-timeout=25 "${args[@]}")
  fi
  log=$build/fuzz-logs/$t.log
  s0=$(date +%s)
  (cd "$art" && "$exe" -print_final_stats=1 -artifact_prefix="$art/" "${args[@]}") >"$log" 2>&1
  rc=$?
  s1=$(date +%s)
  [ "$mode" = smoke ] && rm -rf "$work"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9a-zA-Z]+')
  if [ $rc -eq 0 ]; then
    printf 'fuzz: %-16s ok     %9s execs in %4d s (%s/s)  %s\n' "$t" "${execs:-?}" $((s1 - s0)) \
      "${rate:-?}" "$last"
  else
    failed=$((failed + 1))
    printf 'fuzz: %-16s FAILED (exit %d) after %d s; log %s\n' "$t" $rc $((s1 - s0)) "$log"
    grep -E 'ERROR|SUMMARY|property violated|runtime error' "$log" | head -5
  fi
done
echo "fuzz: ${#targets[@]} harnesses, $failed failed, $(( $(date +%s) - t0 )) s in all"
[ $failed -eq 0 ]
