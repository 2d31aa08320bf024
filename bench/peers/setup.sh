#!/usr/bin/env bash
# bench/peers/setup.sh — installs the peer engine: llama.cpp's prebuilt CPU build through npm's
# node-llama-cpp, pinned by package.json and package-lock.json, into bench/peers/node_modules.
#
# Owns: that one install (npm install, following the lock). Nothing else in the project uses
# it; CI never runs it (it refuses under CI=true): ~725 MB, most of it GPU builds npm installs
# alongside as optional packages.
# The CPU build (@node-llama-cpp/linux-x64) picks its ggml CPU variant at run time (zen4,
# skylakex, haswell, ...); NODE_LLAMA_CPP_SKIP_DOWNLOAD keeps the install from fetching and
# compiling llama.cpp's sources when no prebuilt binary fits: run.sh then fails at load, saying so.
# Checked on Debian 12 x86-64 with node 20.
#
# Usage: bench/peers/setup.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "${CI:-}" = true ]; then
  echo "bench/peers/setup.sh: not in CI (a 700 MB download for a benchmark CI does not run)" >&2
  exit 2
fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "bench/peers/setup.sh: needs node (>= 20) and npm" >&2
  exit 2
fi
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 20 ] || { echo "bench/peers/setup.sh: node $major is too old (>= 20)" >&2; exit 2; }
cd "$here"
# npm install, not npm ci: npm 11's ci rejects a lock file made on one platform because it lacks the
# other platforms' optional binary packages; install still follows the lock for what it holds.
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund
# The prebuilt CPU binary must load here (build: "never" forbids compiling a fallback). From a
# file: node-llama-cpp's binary test fails under `node -e`.
node "$here/llama_bench.mjs" --check
