#!/bin/bash
# flood_cpu.sh — the controller's CPU over one call flood: security/test_replica_memory's
# a_call_flood_is_refused_at_the_call_and_synchronize_recovers (one instance, 20,000 alloc +
# dealloc pairs of 256 KV pages without waiting), measured with `perf stat -e task-clock` on
# the pie-controller the test starts (its start-up included). Prints one line per run.
# Usage: bench/controller/flood_cpu.sh BUILD_DIR [RUNS]   (needs perf)
set -euo pipefail
build=$(cd "${1:?usage: flood_cpu.sh BUILD_DIR [RUNS]}" && pwd)
runs=${2:-3}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((r = 1; r <= runs; r++)); do
    "$build/tests/security_test_replica_memory" --filter '*call_flood*' >"$log" 2>&1 &
    test_pid=$!
    ctl=""
    for _ in $(seq 1 500); do
        ctl=$(pgrep -f "$build/bin/pie-controller" | head -1 || true)
        [ -n "$ctl" ] && break
        sleep 0.01
    done
    [ -n "$ctl" ] || { echo "flood_cpu: the controller never started" >&2; exit 1; }
    ms=$(perf stat -x, -e task-clock -p "$ctl" 2>&1 >/dev/null |
        awk -F, '/task-clock/ {print $1}')
    rc=0
    wait "$test_pid" || rc=$?
    echo "run $r: controller CPU ${ms} ms; test exit $rc"
done
