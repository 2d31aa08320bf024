#!/usr/bin/env bash
# tools/run.sh — the quickstart: installs what is missing, builds what the quickstart needs
# (release build in build/), starts a Pie-C cluster on loopback (controller, CPU worker and
# lifecycle, OpenAI gateway: deploy/local/pie-local.sh) serving the bundled model, runs the
# text_completion inferlet through piectl on a prompt, prints the completion, asks the same of
# the OpenAI-compatible gateway with curl (and prints that curl line), and keeps the cluster
# running for the user's own piectl and curl commands until Ctrl-C.
#
# Owns: the choice of model and prompt, the build of the quickstart's targets, the demo run.
# Does not own: the cluster's processes (pie-local.sh), the inferlet (inferlets/text_completion).
#
# Options: --prompt TEXT, --max-tokens N (default 40), --model DIR (default models/pie-tiny, the
# bundled trained model; the build's generated build/models/small-f32 when it is absent),
# --check (start, run the demo, stop: the exit status says whether everything worked); any other
# option goes to pie-local.sh (--workers 2 --lifecycles 2, --base-port B, ...).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# The demo, run by pie-local.sh --exec inside the cluster (PIE_LOCAL_* set): uploads and runs
# text_completion on the first lifecycle replica. piectl prints the inferlet's stdout (the
# completion, streamed) and then its two messages (the completion again, "reason=... tokens=N");
# shown here once, after the prompt.
demo() { # wasm prompt max_tokens
  local wasm=$1 prompt=$2 max=$3 lc=${PIE_LOCAL_LIFECYCLES%% *} out
  echo "quickstart: piectl --addr $lc run text_completion.wasm --prompt \"$prompt\" --max-tokens $max"
  out=$("$PIE_LOCAL_BIN/piectl" --addr "$lc" --timeout 60000 run --no-stdin "$wasm" \
    --prompt "$prompt" --max-tokens "$max") || { echo "quickstart: the inferlet failed" >&2; return 1; }
  local reason=${out##*$'\n'} body=${out%$'\n'*}
  local half=$(((${#body} - 1) / 2))
  echo
  local bold="" plain=""
  if [ -t 1 ]; then bold=$'\033[1m' plain=$'\033[0m'; fi # the completion in bold on a terminal
  if [ "${body:0:half}"$'\n'"${body:0:half}" = "$body" ]; then
    printf '%s%s%s%s\n' "$prompt" "$bold" "${body:0:half}" "$plain"
  else
    printf '%s\n' "$out" # not the expected shape: show everything piectl printed
  fi
  echo "($reason)"
  echo
  [ -n "${PIE_LOCAL_GATEWAYS:-}" ] || return 0
  local gw=${PIE_LOCAL_GATEWAYS%% *} name body
  local p=${prompt//\\/\\\\}
  p=${p//\"/\\\"} # the prompt as a JSON string
  name=$(basename "$PIE_LOCAL_MODEL")
  body=$(printf '{"model":"%s","prompt":"%s","max_tokens":%s,"temperature":0}' "$name" "$p" "$max")
  echo "quickstart: the same through the OpenAI-compatible gateway (docs/openai.md):"
  echo "  curl $gw/v1/completions -H 'Content-Type: application/json' -d '$body'"
  out=$(curl -fsS "$gw/v1/completions" -H 'Content-Type: application/json' -d "$body") ||
    { echo "quickstart: the gateway request failed" >&2; return 1; }
  echo "$out"
  echo
  echo "quickstart: chat, streamed:"
  echo "  curl -N $gw/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\":\"$name\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"stream\":true}'"
  echo
}
if [ "${1:-}" = __demo ]; then
  shift
  demo "$@"
  exit
fi

cd "$root"
prompt="" max=40 model="" check=0 pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prompt) prompt=$2; shift 2 ;;
    --max-tokens) max=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) pass+=("$1"); shift ;;
  esac
done

bash tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
echo "quickstart: building the services, piectl, the inferlets and the test models"
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target pie-controller pie-worker \
  pie-lifecycle pie-gateway piectl pie-engine-probe inferlet_text_completion inferlet_openai_chat \
  pie_test_models >/dev/null

# The bundled model was trained on tools/tinymodel/corpus.txt (models/pie-tiny/README.md): it
# continues the corpus's sentences. The generated test model is random: its output is noise.
if [ -z "$model" ]; then
  if [ -f models/pie-tiny/config.json ]; then
    model=models/pie-tiny
    prompt=${prompt:-Every Saturday the square}
  else
    model=build/models/small-f32
    echo "quickstart: models/pie-tiny is absent; using the generated random model $model"
  fi
fi
prompt=${prompt:-Once upon a time}

args=(--bin "$root/build/bin" --model "$model" "${pass[@]+"${pass[@]}"}")
[ $check = 1 ] || args+=(--stay)
exec bash deploy/local/pie-local.sh "${args[@]}" \
  --exec bash "$root/tools/run.sh" __demo "$root/build/inferlets/text_completion.wasm" "$prompt" "$max"
