#!/usr/bin/env bash
# tools/test.sh — installs what is missing, builds, and runs every test twice: once in the
# release build (build/) and once under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-asan/). Ends with the skipped tests, named, and one summary line
# "tests: N passed, N failed, N skipped".
# Usage: tools/test.sh [ctest args...]   e.g. tools/test.sh -R rpc
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=$(nproc 2>/dev/null || echo 2)

bash tools/setup.sh || { echo "test: setup failed"; exit 1; }

total_pass=0
total_fail=0
total_skip=0
status=0
skip_log=$(mktemp)
trap 'rm -f "$skip_log"' EXIT

run_suite() { # name build_dir cmake_args...
  local name=$1 dir=$2
  shift 2
  echo "== $name: configure + build ($dir)"
  mkdir -p "$dir"
  if ! cmake -S . -B "$dir" "$@" >"$dir/configure.log" 2>&1; then
    cat "$dir/configure.log"; echo "test: $name: configure failed"; status=1; total_fail=$((total_fail + 1)); return
  fi
  if ! cmake --build "$dir" -j"$jobs" >"$dir/build.log" 2>&1; then
    grep -E 'error|Error' "$dir/build.log" | head -50; echo "test: $name: build failed (see $dir/build.log)"
    status=1; total_fail=$((total_fail + 1)); return
  fi
  echo "== $name: ctest"
  local out
  out=$(cd "$dir" && ctest --output-on-failure --timeout 600 "${ctest_args[@]}" 2>&1)
  local rc=$?
  echo "$out"
  local line
  line=$(echo "$out" | grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' | tail -1)
  if [ -n "$line" ]; then
    local failed all skipped
    failed=$(echo "$line" | sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\1/')
    all=$(echo "$line" | sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\2/')
    # CTest counts a skipped test (SKIP_RETURN_CODE, SKIP_REGULAR_EXPRESSION) as passed; its
    # "did not run" list names them.
    skipped=$(echo "$out" | grep -cE '^[[:space:]]*[0-9]+ - .* \(Skipped\)$' || true)
    echo "$out" | grep -E '^[[:space:]]*[0-9]+ - .* \(Skipped\)$' |
      sed -E "s/^[[:space:]]*[0-9]+ - (.*) \(Skipped\)$/skipped ($name): \1/" >>"$skip_log"
    total_pass=$((total_pass + all - failed - skipped))
    total_fail=$((total_fail + failed))
    total_skip=$((total_skip + skipped))
  else
    total_fail=$((total_fail + 1))
  fi
  [ $rc -eq 0 ] || status=1
}

ctest_args=("$@")
# ASan+UBSan first (CUDA host code is not instrumented, so that suite leaves CUDA out), then the
# release build the benchmarks and the quickstart use.
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  run_suite "asan+ubsan" build-asan -DPIE_ASAN=ON -DPIE_UBSAN=ON -DPIE_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
run_suite "release" build -DCMAKE_BUILD_TYPE=RelWithDebInfo

# libFuzzer smoke (issue 11, item 9): every harness of tests/fuzz over its seed corpus plus a
# few seconds of fuzzing (clang, ASan+UBSan, build-fuzz/); each harness counts as one test.
echo "== fuzz smoke (build-fuzz)"
fuzz_out=$(PIE_FUZZ_JOBS=$jobs bash tests/fuzz/run.sh --smoke 2>&1); fuzz_rc=$?
echo "$fuzz_out"
if [ $fuzz_rc -eq 77 ]; then total_skip=$((total_skip + 1)); echo "skipped (fuzz): tests/fuzz/run.sh --smoke: clang's libFuzzer not found" >>"$skip_log"
else total_pass=$((total_pass + $(grep -c '^fuzz: .* ok ' <<<"$fuzz_out")))
  total_fail=$((total_fail + $(grep -c '^fuzz: .* FAILED' <<<"$fuzz_out")))
  [ $fuzz_rc -eq 0 ] || { status=1; grep -q '^fuzz: .* FAILED' <<<"$fuzz_out" || total_fail=$((total_fail + 1)); }; fi

# Every skip, named, before the summary: a skip is a check this machine did not make.
cat "$skip_log"
echo "tests: $total_pass passed, $total_fail failed, $total_skip skipped"
exit $status
