#!/usr/bin/env bash
# tools/run.sh — the quickstart: installs what is missing, builds, and runs a local Pie-C
# cluster on loopback (deploy/local/pie-local.sh; its options pass through, e.g. --workers 2
# --lifecycles 2, or --check to start, check health and stop).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" >/dev/null
exec bash deploy/local/pie-local.sh --bin "$root/build/bin" "$@"
