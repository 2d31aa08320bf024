#!/usr/bin/env bash
# tests/deploy/local-cluster-failover.sh — issue 7's local-cluster acceptance test: the cluster
# script (deploy/local/pie-local.sh) starts 2 workers, 1 controller and 2 lifecycle replicas
# (no model files and no shared disk: tokenizer and programs come through the controller);
# inferlets uploaded to one replica run through both replicas; one worker is killed with SIGKILL while an instance holds
# KV pages on it; that instance ends with UNAVAILABLE, the instance on the other worker goes on,
# and new launches through both replicas succeed on the surviving worker; the cluster then stops
# cleanly (every remaining service exits 0, no sanitizer report in any log).
#
# Owns: the scenario and its checks, all through piectl (public Lifecycle API on the replicas,
# Controller/ClusterStatus on the controller).
# Does not own: starting and stopping the processes (pie-local.sh --exec runs this file again,
# inside the cluster, with the PIE_LOCAL_* variables set).
#
# Usage: local-cluster-failover.sh BIN_DIR INFERLETS_DIR   (registered with CTest as
# deploy/local_cluster_survives_a_worker_loss). Uses the build's generated small-f32 model.
# Synchronisation is by polling piectl status / files with a deadline, never by fixed sleeps.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }

# ---- outside: start the cluster around this script -------------------------------------------
if [ -z "${PIE_LOCAL_RUN_DIR:-}" ]; then
  [ $# = 2 ] || { echo "usage: $0 BIN_DIR INFERLETS_DIR" >&2; exit 2; }
  bin=$(cd "$1" && pwd) inferlets=$(cd "$2" && pwd)
  rundir=$(mktemp -d /tmp/pie-failover.XXXXXX)
  st=0
  bash "$here/../../deploy/local/pie-local.sh" --bin "$bin" --model "$bin/../models/small-f32" \
    --workers 2 --lifecycles 2 --base-port random --run-dir "$rundir" --wait-s 120 \
    --exec bash "$0" "$bin" "$inferlets" || st=$?
  if grep -l -E "AddressSanitizer|LeakSanitizer|runtime error:" "$rundir"/*.log; then
    echo "FAIL: a service reported a sanitizer error (logs above)" >&2
    st=1
  fi
  if [ $st = 0 ]; then
    rm -rf "$rundir"
  else
    for f in "$rundir"/*.log; do echo "--- tail of $f" >&2; tail -n 20 "$f" >&2; done
    echo "logs kept in $rundir" >&2
  fi
  exit $st
fi

# ---- inside: the scenario ---------------------------------------------------------------------
inferlets=$2
read -ra lc <<<"$PIE_LOCAL_LIFECYCLES"
[ ${#lc[@]} = 2 ] || fail "expected 2 lifecycle replicas, PIE_LOCAL_LIFECYCLES='$PIE_LOCAL_LIFECYCLES'"
work=$PIE_LOCAL_RUN_DIR/failover
mkdir -p "$work"
deadline_s=120 # for every poll below: sanitizer builds on two shared cores are slow
prompt="The quick brown fox"

piectl() { "$PIE_LOCAL_BIN/piectl" --timeout 60000 "$@"; }
status() { piectl --addr "$PIE_LOCAL_CONTROLLER" status; }
# Polls `cond` (a shell command) every 0.1 s until it succeeds or deadline_s pass.
poll() { # what cond...
  local what=$1 end=$((SECONDS + deadline_s))
  shift
  until "$@"; do
    [ $SECONDS -lt $end ] || { status >&2 || true; fail "no $what within $deadline_s s"; }
    sleep 0.1
  done
}
# kv_pages used on the worker with group id $1, from `piectl status` ("kv_pages=USED/EFFECTIVE").
kv_used() { status | sed -n -E "s/^ +#[0-9]+ +$1 .* kv_pages=([0-9]+)\/.*/\1/p"; }
# A run in the background: its stdout, stderr and (once it ended) exit status in $work/<tag>.*
run_bg() { # tag addr program args...
  local tag=$1 addr=$2
  shift 2
  (st=0; piectl --addr "$addr" run --no-stdin "$@" >"$work/$tag.out" 2>"$work/$tag.err" || st=$?
   echo $st >"$work/$tag.rc.tmp" && mv "$work/$tag.rc.tmp" "$work/$tag.rc") &
}
ended() { [ -f "$work/$1.rc" ]; }
rc_of() { cat "$work/$1.rc"; }
# text_completion, greedy, exactly 12 tokens: prints its output; fails unless it exited 0.
complete() { # addr
  local out
  out=$(piectl --addr "$1" run --no-stdin "$tc" --prompt "$prompt" --max-tokens 12 --ignore-eos) ||
    fail "text_completion through $1 exited with $?"
  echo "$out" | tail -n 1 | grep -qx "reason=max_tokens tokens=12" ||
    fail "text_completion through $1 did not end with 'reason=max_tokens tokens=12':"$'\n'"$out"
  echo "$out"
}

echo "== upload text_completion, messaging_producer and messaging_consumer to ${lc[0]} only"
# The replicas share no disk: ${lc[1]} fetches each program from the controller's registry at
# its first launch there.
declare -A id
for p in text_completion messaging_producer messaging_consumer; do
  a=$(piectl --addr "${lc[0]}" upload "$inferlets/$p.wasm" "$p")
  [[ $a =~ ^[0-9a-f]{64}$ ]] || fail "upload of $p to ${lc[0]} printed '$a', not a SHA-256 id"
  id[$p]=$a
done
tc=${id[text_completion]} prod=${id[messaging_producer]} cons=${id[messaging_consumer]}

echo "== text_completion through both replicas, both workers up"
before0=$(complete "${lc[0]}")
before1=$(complete "${lc[1]}")
echo "$before0"
[ "$before0" = "$before1" ] || fail "greedy output differs between replicas:"$'\n'"$before0"$'\n---\n'"$before1"

echo "== one instance holding KV pages on each worker"
# A producer fills its prompt, then waits for a consumer on its topic: it holds KV pages until
# released. Placement takes the least loaded worker, so the two land on different workers.
run_bg hold-0 "${lc[0]}" "$prod" --topic failover-0 --prompt "$prompt" --lines 2 --tokens-per-line 4
run_bg hold-1 "${lc[1]}" "$prod" --topic failover-1 --prompt "$prompt" --lines 2 --tokens-per-line 4
both_hold() { [ "$(kv_used worker-0)" -gt 0 ] 2>/dev/null && [ "$(kv_used worker-1)" -gt 0 ] 2>/dev/null; }
poll "KV pages in use on both workers" both_hold
status
for t in hold-0 hold-1; do ! ended $t || fail "$t ended early ($(rc_of $t)): $(cat "$work/$t.err")"; done

echo "== SIGKILL worker-1"
wpid=$(cat "$PIE_LOCAL_RUN_DIR/pids/worker-1.pid")
rm "$PIE_LOCAL_RUN_DIR/pids/worker-1.pid" # taken out of pie-local's clean-stop check
kill -KILL "$wpid"
one_ended() { ended hold-0 || ended hold-1; }
poll "end of the instance placed on worker-1" one_ended
if ended hold-0; then lost=hold-0 kept=hold-1 kept_lc=${lc[1]} kept_topic=failover-1
else lost=hold-1 kept=hold-0 kept_lc=${lc[0]} kept_topic=failover-0; fi
# piectl exits with 100 + the status code when an instance did not end by itself: 114 UNAVAILABLE
[ "$(rc_of $lost)" = 114 ] || fail "$lost exited with $(rc_of $lost), expected 114 (UNAVAILABLE): $(cat "$work/$lost.err")"
grep -q "instance ended: UNAVAILABLE: .*worker-1" "$work/$lost.err" ||
  fail "$lost's error does not name UNAVAILABLE and worker-1: $(cat "$work/$lost.err")"
echo "$lost: $(grep "instance ended" "$work/$lost.err")"
only_worker0() {
  local s
  s=$(status)
  grep -q "^workers (1)" <<<"$s" && grep -qE "^ +#[0-9]+ +worker-0 " <<<"$s" &&
    grep -q "^lifecycle replicas (2)" <<<"$s"
}
poll "cluster status with worker-0 alone and both replicas" only_worker0
! ended $kept || fail "$kept (on worker-0) ended with $(rc_of $kept) when worker-1 died: $(cat "$work/$kept.err")"

echo "== the instance on worker-0 goes on: a consumer through the other replica releases it"
other_lc=${lc[0]}
[ "$kept_lc" != "${lc[0]}" ] || other_lc=${lc[1]}
consumed=$(piectl --addr "$other_lc" run --no-stdin "$cons" --topic "$kept_topic") ||
  fail "messaging_consumer exited with $?"
poll "end of $kept" ended $kept
[ "$(rc_of $kept)" = 0 ] || fail "$kept exited with $(rc_of $kept): $(cat "$work/$kept.err")"
tail -n 1 "$work/$kept.out" | grep -qx "consumers=1 lines=2" || fail "$kept output: $(cat "$work/$kept.out")"
echo "$consumed" | tail -n 1 | grep -qx "received=2" || fail "consumer output: $consumed"

echo "== new launches through both replicas run on worker-0"
calls() { status | sed -n -E "s/^ +#[0-9]+ +lifecycle-$1 .* calls=([0-9]+)$/\1/p"; }
c0=$(calls 0) c1=$(calls 1)
after0=$(complete "${lc[0]}")
after1=$(complete "${lc[1]}")
[ "$after0" = "$before0" ] || fail "after the loss, ${lc[0]} produced"$'\n'"$after0"$'\n'"instead of"$'\n'"$before0"
[ "$after1" = "$before0" ] || fail "after the loss, ${lc[1]} produced"$'\n'"$after1"$'\n'"instead of"$'\n'"$before0"
s=$(status)
echo "$s"
grep -q "^workers (1)" <<<"$s" || fail "status after the new launches lists other workers"
if [ "$(calls 0)" -le "$c0" ] || [ "$(calls 1)" -le "$c1" ]; then
  fail "both replicas should have sent calls to the controller (worker-0 is the only worker)"
fi
echo "PASS: worker-1's instance ended with UNAVAILABLE; worker-0 served both replicas afterwards"
