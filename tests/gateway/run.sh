#!/usr/bin/env bash
# tests/gateway/run.sh BIN_DIR — the OpenAI gateway against the official `openai` npm client.
#
# Starts a local cluster (deploy/local/pie-local.sh: 1 worker, 2 lifecycle replicas, 1 gateway,
# a bearer token) and runs openai_client.mjs against the gateway. Without node or the openai
# package (tools/setup.sh installs it into .deps/) the test is skipped (77) — except under
# CI=true, where a missing prerequisite fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$1
missing=""
command -v node >/dev/null 2>&1 || missing="node"
[ -f "$root/.deps/node_modules/openai/package.json" ] || missing="${missing:+$missing, }the openai npm package (.deps/)"
[ -x "$bin/pie-gateway" ] || missing="${missing:+$missing, }$bin/pie-gateway"
[ -f "$bin/../inferlets/openai_chat.wasm" ] || missing="${missing:+$missing, }openai_chat.wasm"
if [ -n "$missing" ]; then
  if [ "${CI:-}" = true ]; then echo "gateway test: missing $missing (run tools/setup.sh)" >&2; exit 1; fi
  echo "gateway test: skipped: missing $missing (run tools/setup.sh)"; exit 77
fi
token="gw-test-$RANDOM$RANDOM"
# The drain check streams 300 tokens after SIGTERM: the default server.shutdown_grace (5 s) cut
# that stream once on an oversubscribed machine (6 runnable threads a core); what the check
# asserts is the drain, not how long it may take.
export PIE_SERVER_SHUTDOWN_GRACE=60s
exec bash "$root/deploy/local/pie-local.sh" --bin "$bin" --workers 1 --lifecycles 2 --gateways 1 \
  --base-port random --token "$token" \
  --exec env PIE_TEST_TOKEN="$token" PIE_TEST_DEPS="$root/.deps/node_modules" \
  PIE_TEST_INFERLETS="$bin/../inferlets" node "$here/openai_client.mjs"
