#!/usr/bin/env bash
# tests/deploy/local-cluster-tp.sh — a local cluster whose worker is a tensor-parallel group
# (issue 14): deploy/local/pie-local.sh --tp 2 starts one pie-worker that forks 2 ranks; the
# example inferlets text_completion and parallel_generation run through piectl and print exactly
# what they print on a cluster started with --tp 1; `piectl status` shows the worker with tp=2
# and each of its ranks;
# both clusters stop cleanly (every service exits 0, no sanitizer report in any log).
#
# Owns: the scenario and its checks. Does not own: starting and stopping the processes
# (pie-local.sh --exec runs this file again inside each cluster, with PIE_LOCAL_* set).
#
# Usage: local-cluster-tp.sh BIN_DIR INFERLETS_DIR   (registered with CTest as
# deploy/local_cluster_with_a_tp2_worker_runs_inferlets). Uses the build's small-f32 model.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }

# ---- outside: one cluster per tp size, then compare ------------------------------------------
if [ -z "${PIE_LOCAL_RUN_DIR:-}" ]; then
  [ $# = 2 ] || { echo "usage: $0 BIN_DIR INFERLETS_DIR" >&2; exit 2; }
  bin=$(cd "$1" && pwd) inferlets=$(cd "$2" && pwd)
  work=$(mktemp -d /tmp/pie-tp.XXXXXX)
  st=0
  for tp in 1 2; do
    mkdir -p "$work/tp$tp"
    bash "$here/../../deploy/local/pie-local.sh" --bin "$bin" --model "$bin/../models/small-f32" \
      --tp $tp --gateways 0 --base-port random --run-dir "$work/tp$tp" --wait-s 120 \
      --exec bash "$0" "$bin" "$inferlets" "$tp" "$work/out-tp$tp" || st=$?
    if grep -l -E "AddressSanitizer|LeakSanitizer|runtime error:" "$work/tp$tp"/*.log; then
      echo "FAIL: a service reported a sanitizer error (logs above)" >&2
      st=1
    fi
    [ $st = 0 ] || break
  done
  if [ $st = 0 ] && ! cmp -s "$work/out-tp1" "$work/out-tp2"; then
    echo "FAIL: the inferlets printed something else at tp 2:" >&2
    diff "$work/out-tp1" "$work/out-tp2" >&2 || true
    st=1
  fi
  if [ $st = 0 ]; then
    echo "the inferlets printed the same at tp 1 and tp 2 ($(wc -l <"$work/out-tp2") lines)"
    rm -rf "$work"
  else
    for f in "$work"/tp*/*.log; do echo "--- tail of $f" >&2; tail -n 20 "$f" >&2; done
    echo "logs kept in $work" >&2
  fi
  exit $st
fi

# ---- inside: the inferlets --------------------------------------------------------------------
inferlets=$2 tp=$3 out=$4
lc=${PIE_LOCAL_LIFECYCLES%% *}
piectl() { "$PIE_LOCAL_BIN/piectl" --timeout 60000 "$@"; }
piectl --addr "$PIE_LOCAL_CONTROLLER" status | grep -qE "^ +#[0-9]+ +worker-0 .* tp=$tp " ||
  fail "piectl status does not show worker-0 with tp=$tp"
if [ "$tp" -gt 1 ]; then # every rank of the group, with its device, host and pid
  status=$(piectl --addr "$PIE_LOCAL_CONTROLLER" status)
  for r in $(seq 0 $((tp - 1))); do
    grep -qE "^ +rank $r: device=cpu: .* host=.+ pid=[1-9]" <<<"$status" ||
      fail "piectl status does not list rank $r of the tp=$tp group: $status"
  done
fi
tc=$(piectl --addr "$lc" upload "$inferlets/text_completion.wasm" text_completion)
pg=$(piectl --addr "$lc" upload "$inferlets/parallel_generation.wasm" parallel_generation)
{
  piectl --addr "$lc" run --no-stdin "$tc" --prompt "The quick brown fox" --max-tokens 24 --ignore-eos
  piectl --addr "$lc" run --no-stdin "$pg" --prompt "Once upon a time there was" --n 3 \
    --suffixes " a king| a cat|" --max-tokens 16 --ignore-eos
} >"$out" || fail "an inferlet failed at tp $tp (exit $?)"
echo "tp $tp:"
cat "$out"
