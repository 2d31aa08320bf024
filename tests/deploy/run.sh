#!/usr/bin/env bash
# tests/deploy/run.sh — the deploy tests (registered with CTest in tests/deploy/CMakeLists.txt)
# and the command that regenerates their golden files. Everything runs offline, with the npm
# tools tools/setup.sh installs into .deps/ (Helm 3.6.2, dockerfile-utils, dockerfilelint,
# kubernetes-models, js-yaml, ajv).
#
#   run.sh helm-lint NAME                 helm lint --strict with the values of NAME
#   run.sh golden NAME                    helm template == tests/deploy/golden/NAME.yaml
#   run.sh validate NAME                  rendered manifests valid against Kubernetes schemas
#   run.sh variants                       other value combinations render and validate
#   run.sh configs-load NAME BIN_DIR      rendered service configs load in the real binaries
#   run.sh schema-rejects                 values.schema.json rejects wrong types, clearly
#   run.sh template-rejects               impossible shapes fail with a message
#   run.sh backend BIN_DIR                GPU worker pods run backend cuda, others cpu/null
#   run.sh wiring BIN_DIR                 ports, probes, addresses and Secrets line up
#   run.sh wiring-selftest BIN_DIR        the wiring check reports every flaw of broken/wiring.yaml
#   run.sh schema-current BIN_DIR         values.schema.json config sections match the binaries
#   run.sh metric-names                   every pie_* metric the chart's alerts, dashboard and HPA
#                                         read is a family docs/operators.md lists
#   run.sh validator-selftest             the validator reports every flaw of broken/manifests.yaml
#   run.sh dockerfile-lint                dockerfile-utils + dockerfilelint + project rules
#   run.sh dockerfile-selftest            the project rules catch every flaw of broken/Dockerfile
#   run.sh runtime-deps BIN_DIR           deploy/docker/runtime-deps.sh resolves the binaries' libraries
#   run.sh no-kube-version                helm template without --kube-version renders and validates
#   run.sh update-golden                  rewrite tests/deploy/golden/*.yaml from the chart
#
# NAME is "default" (helm/pie/values.yaml), a values file helm/pie/ci/NAME-values.yaml or one of
# the tests' own, tests/deploy/values-NAME.yaml.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
deps="$root/.deps"
helm="$deps/node_modules/.bin/helm"
chart="$root/helm/pie"
# Render settings of the golden files: release "pie" in namespace "pie", Kubernetes 1.30.
release=pie namespace=pie kube_version=1.30.0
# Worker keys the chart passes as PIE_* variables ahead of the work that defines them
# (docs/deploy.md, "Forwarded keys"); the current binaries ignore unknown variables.
forwarded="PIE_MEMORY_POLICY PIE_MEMORY_HOST_POOL"

die() { echo "deploy-test: $*" >&2; exit 1; }
need_tools() {
  [ -x "$helm" ] || die "no Helm at $helm (run tools/setup.sh)"
  command -v node >/dev/null || die "no node on PATH (run tools/setup.sh)"
  [ -d "$deps/node_modules/kubernetes-models" ] || die "npm tools missing in $deps (run tools/setup.sh)"
}
values_args() { # NAME -> helm -f arguments
  case "$1" in
    default) ;;
    *) if [ -f "$chart/ci/$1-values.yaml" ]; then echo "-f $chart/ci/$1-values.yaml"
       elif [ -f "$here/values-$1.yaml" ]; then echo "-f $here/values-$1.yaml"
       else die "no values file helm/pie/ci/$1-values.yaml or tests/deploy/values-$1.yaml"; fi ;;
  esac
}
# Secrets a values file expects to exist already (auth.existingSecret, or a header line
# "# external-secrets: a b"), for the validator.
external_secrets() {
  local f
  for f in "$chart/ci/$1-values.yaml" "$here/values-$1.yaml"; do
    [ -f "$f" ] || continue
    sed -n 's/^  existingSecret: *"\{0,1\}\([^"]*\)"\{0,1\} *$/--external-secret \1/p' "$f"
    sed -n 's/^# external-secrets: *//p' "$f" | tr ' ' '\n' | sed -n 's/^\(..*\)$/--external-secret \1/p'
  done
  return 0
}
# helm template. Offline renders are deterministic (no random token: stable-renders below), so
# the golden files are raw renders.
render() { # NAME
  # shellcheck disable=SC2046
  "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
    $(values_args "$1")
}
tmpdir() { mktemp -d "${TMPDIR:-/tmp}/pie-deploy-test.XXXXXX"; }
# Other shapes of the chart than the golden ones, one --set argument a line (variants, wiring).
variants() {
  cat <<'VARIANTS'
auth.enabled=false,metrics.podAnnotations=false,serviceAccount.create=false
auth.token=fixed-token,auth.secretKey=bearer,metrics.serviceMonitor.enabled=true,lifecycle.headlessService.enabled=false,gateway.enabled=false
lifecycle.autoscaling.enabled=false,lifecycle.replicas=3,lifecycle.podDisruptionBudget.enabled=false
lifecycle.autoscaling.targetMemoryUtilizationPercentage=80,lifecycle.service.type=LoadBalancer,lifecycle.cacheClaim=pie-programs
lifecycle.cacheSizeLimit=1.5Gi,lifecycle.replicas=2
worker.model.existingClaim=models,worker.replicas=4
worker.leaderWorkerSet.enabled=true
auth.tenantsSecret=pie-tenants,lifecycle.replicas=2
tls.enabled=true,tls.secretName=pie-tls
networkPolicy.enabled=true,networkPolicy.clientsFrom[0].namespaceSelector.matchLabels.team=ml,networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring
metrics.grafanaDashboard.enabled=true,metrics.prometheusRule.enabled=true,metrics.prometheusRule.labels.release=kps,lifecycle.autoscaling.waitingInstances=4
worker.leaderWorkerSet.enabled=true,worker.replicas=3,worker.config.backend=cpu
worker.config.backend=cpu,worker.config.engine.threads=8,worker.resources.requests.cpu=8
worker.config.backend=cpu,worker.tensorParallel.size=4,worker.config.engine.threads=2,worker.resources.requests.cpu=8
controller.port=6000,controller.metricsPort=6001,lifecycle.port=6002,lifecycle.metricsPort=6003,lifecycle.service.port=443,worker.port=6004,worker.metricsPort=6005,worker.tensorParallel.port=6006,clusterDomain=k8s.example.internal
fullnameOverride=a-rather-long-release-name-for-pie-c-tests,worker.replicas=100
image.registry=registry.local:5000/team/,image.tag=dev,tests.image=busybox:1.36,tests.gatewayImage=curlimages/curl:8.10.1
gateway.autoscaling.enabled=false,gateway.replicas=3,gateway.podDisruptionBudget.enabled=false,gateway.service.type=LoadBalancer,gateway.service.loadBalancerSourceRanges[0]=10.0.0.0/8,gateway.config.http.max_connections=4096
gateway.ingress.enabled=true,gateway.ingress.className=nginx,gateway.ingress.annotations.nginx\.ingress\.kubernetes\.io/proxy-buffering=off,gateway.ingress.tls[0].secretName=pie-tls,gateway.ingress.tls[0].hosts[0]=pie.example.com,gateway.port=8080,gateway.service.port=80,gateway.grpcPort=6010,gateway.metricsPort=6011,lifecycle.port=6002
gateway.httpRoute.enabled=true,gateway.httpRoute.parentRefs[0].name=public,gateway.httpRoute.parentRefs[0].namespace=gateway-system,gateway.httpRoute.hostnames[0]=pie.example.com,gateway.autoscaling.targetMemoryUtilizationPercentage=80,auth.enabled=false
VARIANTS
}
# The values files rendered by name (golden, validate, configs-load, wiring).
named_values() { echo default; (cd "$chart/ci" && ls -- *-values.yaml | sed 's/-values\.yaml$//'); echo large-numbers; echo extras; }

cmd=${1:-}
shift || true
case "$cmd" in
  no-kube-version)
    need_tools
    # `helm template` as a GitOps tool runs it: no cluster and no --kube-version (Helm 3.6's
    # offline default is Kubernetes 1.20.0); the chart must render and validate.
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    "$helm" template "$release" "$chart" --namespace "$namespace" >"$t/render.yaml"
    node "$here/validate-manifests.js" --deps "$deps" "$t/render.yaml"
    ;;

  stable-renders)
    need_tools
    # GitOps tools (Argo CD, Flux) run `helm template` on every sync: two renders of the same
    # values must be byte-identical, or each sync rotates the token under running pods (issue 15,
    # item 8). Raw renders: no normalisation of the token here.
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    for args in "" "--set auth.token=fixed-token" "-f $chart/ci/production-values.yaml"; do
      for n in 1 2; do
        # shellcheck disable=SC2086
        "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
          $args >"$t/render-$n.yaml" || die "helm template ${args:-(default values)} failed"
      done
      diff -u "$t/render-1.yaml" "$t/render-2.yaml" >/dev/null ||
        die "two offline renders differ (${args:-default values}): $(diff "$t/render-1.yaml" "$t/render-2.yaml" | grep -m2 '^[<>]' | cut -c1-120 | tr '\n' ' ')"
      echo "two offline renders are identical (${args:-default values})"
    done
    # An explicit token is the one rendered; without one, an offline render holds no token at all.
    "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
      --set auth.token=fixed-token >"$t/fixed.yaml"
    grep -q "token: \"$(printf fixed-token | base64)\"" "$t/fixed.yaml" ||
      die "auth.token=fixed-token is not the token of the rendered Secret"
    "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
      >"$t/default.yaml"
    if grep -q '^kind: Secret' "$t/default.yaml"; then
      die "an offline render without auth.token or auth.existingSecret renders a Secret (its token cannot stay the same between renders)"
    fi
    grep -q '^# pie: external Secret pie-auth ' "$t/default.yaml" ||
      die "an offline render does not say which Secret the operator must create"
    echo "auth.token is rendered as given; an offline render without it names the Secret to create"
    ;;

  helm-lint)
    need_tools
    # shellcheck disable=SC2046
    "$helm" lint --strict "$chart" $(values_args "$1")
    ;;

  golden)
    need_tools
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    render "$1" >"$t/render.yaml"
    if ! diff -u "$here/golden/$1.yaml" "$t/render.yaml"; then
      die "the chart renders differently from tests/deploy/golden/$1.yaml; if the change is intended, run tests/deploy/run.sh update-golden and review the diff"
    fi
    echo "helm template ($1) matches tests/deploy/golden/$1.yaml ($(grep -c '^kind:' "$t/render.yaml") objects)"
    ;;

  update-golden)
    need_tools
    mkdir -p "$here/golden"
    for name in default $(cd "$chart/ci" && ls -- *-values.yaml | sed 's/-values\.yaml$//'); do
      render "$name" >"$here/golden/$name.yaml"
      echo "wrote tests/deploy/golden/$name.yaml"
    done
    ;;

  validate)
    need_tools
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    render "$1" >"$t/$1.yaml"
    # shellcheck disable=SC2046
    node "$here/validate-manifests.js" --deps "$deps" $(external_secrets "$1") "$t/$1.yaml"
    ;;

  variants)
    need_tools
    # Other shapes of the chart than the golden ones, each rendered and validated offline.
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    i=0
    while IFS= read -r set; do
      i=$((i + 1))
      echo "variant $i: --set $set"
      "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
        --set "$set" >"$t/variant-$i.yaml"
    done < <(variants)
    # pie-tenants, pie-tls: Secrets an operator creates (auth.tenantsSecret, tls.secretName).
    node "$here/validate-manifests.js" --deps "$deps" --external-secret pie-tenants \
      --external-secret pie-tls "$t"/variant-*.yaml
    ;;

  backend)
    need_tools
    # Each case: the backend every worker pod must run (pie-worker --print-config on the rendered
    # ConfigMap, with the pod's PIE_* variables), the GPUs it must request, the helm arguments.
    bin=$(cd "$1" && pwd)
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    rc=0 i=0
    while read -r want gpus args; do
      i=$((i + 1))
      # shellcheck disable=SC2086
      "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
        $args >"$t/case-$i.yaml" || { echo "FAIL: $args does not render"; rc=1; continue; }
      echo "case $i: ${args:-(default values)} -> backend $want, $gpus GPU(s) per worker pod"
      node "$here/check-wiring.js" --deps "$deps" --bin "$bin" --expect-backend "$want" \
        --expect-gpus "$gpus" "$t/case-$i.yaml" || rc=1
    done <<CASES
cuda 1
cuda 1 --set worker.config.backend=cuda
cpu 0 --set worker.config.backend=cpu
null 0 --set-string worker.config.backend=null
cuda 1 --set worker.leaderWorkerSet.enabled=true
cpu 0 --set worker.leaderWorkerSet.enabled=true,worker.config.backend=cpu
cpu 0 --set worker.tensorParallel.size=2,worker.config.backend=cpu
cpu 0 -f $chart/ci/cpu-pods-values.yaml
cuda 1 -f $here/values-large-numbers.yaml
cuda 4 --set worker.tensorParallel.size=4
cuda 8 --set worker.tensorParallel.size=8,worker.config.backend=cuda
CASES
    exit $rc
    ;;

  wiring)
    need_tools
    # Every named values file and every variant: ports, probes, addresses and Secrets line up
    # (tests/deploy/check-wiring.js), as the binaries of BIN_DIR read the rendered configs.
    bin=$(cd "$1" && pwd)
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    rc=0
    for name in $(named_values); do
      render "$name" >"$t/$name.yaml"
      # shellcheck disable=SC2046
      node "$here/check-wiring.js" --deps "$deps" --bin "$bin" $(external_secrets "$name") "$t/$name.yaml" || rc=1
    done
    i=0
    while IFS= read -r set; do
      i=$((i + 1))
      "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version" \
        --set "$set" >"$t/variant-$i.yaml"
      echo "variant $i: --set $set"
      node "$here/check-wiring.js" --deps "$deps" --bin "$bin" --external-secret pie-tenants \
        --external-secret pie-tls "$t/variant-$i.yaml" || rc=1
    done < <(variants)
    exit $rc
    ;;

  wiring-selftest)
    need_tools
    out=$(node "$here/check-wiring.js" --deps "$deps" --bin "$(cd "$1" && pwd)" "$here/broken/wiring.yaml" || true)
    rc=0
    while IFS= read -r want; do
      [ -n "$want" ] || continue
      if grep -qF -- "$want" <<<"$out"; then echo "caught: $want"; else echo "MISSED: $want"; rc=1; fi
    done <"$here/broken/wiring.expected"
    [ $rc = 0 ] || { echo "check-wiring output:"; echo "$out"; }
    exit $rc
    ;;

  configs-load)
    need_tools
    name=$1 bin=$(cd "$2" && pwd)
    t=$(tmpdir); trap 'rm -rf "$t"' EXIT
    render "$name" >"$t/render.yaml"
    node "$here/render-tools.js" --deps "$deps" configs "$t/render.yaml" "$t"
    rc=0
    for svc in controller worker lifecycle gateway; do
      [ -f "$t/$svc.yaml" ] || { echo "FAIL: no ConfigMap with $svc.yaml"; rc=1; continue; }
      # The binary checks every key, type and range, exactly as in the pod.
      if ! (cd "$t" && env -i PATH="$PATH" "$bin/pie-$svc" --config "$svc.yaml" --print-config >"$svc.effective" 2>"$svc.err"); then
        echo "FAIL: pie-$svc rejects the rendered $svc.yaml:"; cat "$t/$svc.err"; sed 's/^/    /' "$t/$svc.yaml"; rc=1; continue
      fi
      # The binary's own key list; a failed or empty listing is its own failure, not a verdict
      # on the rendered variables.
      if ! "$bin/pie-$svc" --help-config >"$t/$svc.keys" 2>"$t/$svc.keys.err"; then
        echo "FAIL: pie-$svc --help-config failed:"; cat "$t/$svc.keys.err"; rc=1; continue
      fi
      known=$(sed -n 's/^| `[^`]*` | `\(PIE_[A-Z0-9_]*\)` |.*/\1/p' "$t/$svc.keys")
      [ -n "$known" ] || { echo "FAIL: pie-$svc --help-config listed no PIE_* keys:"; cat "$t/$svc.keys"; rc=1; continue; }
      for var in $(cat "$t/$svc.env" 2>/dev/null); do
        if grep -qx "$var" <<<"$known"; then continue; fi
        if [ "$svc" = worker ] && grep -q " $var " <<<" $forwarded "; then continue; fi
        echo "FAIL: the $svc pods set $var, which is neither a key of pie-$svc (--help-config) nor a documented forwarded key"; rc=1
      done
      for var in $forwarded; do
        if grep -qx "$var" <<<"$known"; then
          echo "note: $var is now a key of pie-$svc: render it into the ConfigMap and drop it from the forwarded list (helm/pie, tests/deploy/run.sh, docs/deploy.md)"
        fi
      done
      # Every number of the rendered file survives into the effective configuration (a value
      # printed as 1.6777216e+07 would have been rejected above; this catches rounding).
      python3 - "$t/$svc.yaml" "$t/$svc.effective" <<'PY' || rc=1
import re, sys
units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
def leaves(path):
    out, section = {}, ""
    for line in open(path):
        line = line.split(" #")[0].rstrip()
        m = re.match(r"^(\w+):\s*$", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^\s+(\w+):\s*\"?([^\"]*)\"?$", line)
        if m:
            out[f"{section}.{m.group(1)}"] = m.group(2)
    return out
rendered, effective = leaves(sys.argv[1]), leaves(sys.argv[2])
bad = 0
for key, v in rendered.items():
    if re.fullmatch(r"[0-9]+", v):
        e = effective.get(key, "")
        m = re.fullmatch(r"([0-9]+)([KMGT]iB|B)?", e)
        got = int(m.group(1)) * units.get(m.group(2) or "B", 1) if m else None
        if got != int(v):
            print(f"FAIL: {key}: rendered {v}, effective {e!r}")
            bad = 1
sys.exit(bad)
PY
      echo "ok: pie-$svc loads the rendered $svc.yaml ($(grep -c '' "$t/$svc.yaml") lines); its pods set $(tr '\n' ' ' <"$t/$svc.env" 2>/dev/null)"
    done
    exit $rc
    ;;

  schema-rejects)
    need_tools
    # Each case: --set arguments, then the message Helm must print (from values.schema.json).
    rc=0
    check() {
      local set=$1 want=$2 out
      if out=$("$helm" template "$release" "$chart" --kube-version "$kube_version" --set "$set" 2>&1); then
        echo "FAIL: --set $set was accepted"; rc=1; return
      fi
      if ! grep -qF -- "$want" <<<"$out"; then
        echo "FAIL: --set $set: expected '$want' in:"; echo "$out"; rc=1; return
      fi
      echo "ok: --set $set -> $want"
    }
    check worker.replicas=two '- worker.replicas: Invalid type. Expected: integer, given: string'
    check worker.config.pool.kv_pages=lots '- worker.config.pool.kv_pages: Invalid type. Expected: integer, given: string'
    check lifecycle.autoscaling.enabled=maybe '- lifecycle.autoscaling.enabled: Invalid type. Expected: boolean, given: string'
    check worker.config.pool.kv_pagez=8 '- worker.config.pool: Additional property kv_pagez is not allowed'
    check worker.config.server.listen=0.0.0.0:1 '- worker.config.server: Additional property listen is not allowed'
    check controller.config.log.level=loud '- controller.config.log.level: controller.config.log.level must be one of the following: "debug", "info", "warn", "error", "off"'
    check worker.config.server.threads=100 '- worker.config.server.threads: Must be less than or equal to 64'
    check worker.memory.policy=fast '- worker.memory.policy: worker.memory.policy must be one of the following: "gpu", "swap", "offload", "auto"'
    check worker.config.server.max_message=4MB/s '- worker.config.server.max_message: Does not match pattern'
    check worker.tensorParallel.size=0 '- worker.tensorParallel.size: Must be greater than or equal to 1'
    check worker.config.backend=tpu '- worker.config.backend: worker.config.backend must be one of the following: "cpu", "cuda", "null"'
    check workers.replicas=2 '- (root): Additional property workers is not allowed'
    check gateway.config.http.listen=0.0.0.0:1 '- gateway.config.http: Additional property listen is not allowed'
    check gateway.config.lifecycle.address=x:1 '- gateway.config.lifecycle: Additional property address is not allowed'
    check gateway.config.http.max_connections=0 '- gateway.config.http.max_connections: Must be greater than or equal to 1'
    check gateway.ingress.hosts[0].paths[0].path=v1 '- gateway.ingress.hosts.0.paths.0.path: Does not match pattern'
    check gateway.enabled=yes '- gateway.enabled: Invalid type. Expected: boolean, given: string'
    # Self-contained: every $ref points into the schema itself (Helm must not fetch anything).
    if grep -nE '"\$ref": *"[^#]' "$chart/values.schema.json"; then
      echo "FAIL: values.schema.json refers outside itself"; rc=1
    else
      echo "ok: values.schema.json is self-contained ($(grep -c '"\$ref"' "$chart/values.schema.json") local \$refs)"
    fi
    exit $rc
    ;;

  template-rejects)
    need_tools
    rc=0
    check() {
      local want=$1 out
      shift
      if out=$("$helm" template "$release" "$chart" --kube-version "$kube_version" "$@" 2>&1); then
        echo "FAIL: $* was accepted"; rc=1; return
      fi
      if ! grep -qF -- "$want" <<<"$out"; then
        echo "FAIL: $*: expected '$want' in:"; echo "$out"; rc=1; return
      fi
      echo "ok: $* -> $want"
    }
    # Groups the chart cannot render: cuda groups spanning pods (NCCL's ports not wired yet),
    # groups on the null backend.
    pods_cuda='groups spanning pods run on the cpu backend only so far'
    check "worker.tensorParallel.size is 2 with backend null: tensor-parallel groups run on the cpu and cuda backends" \
      --set worker.tensorParallel.size=2 --set-string worker.config.backend=null
    check "worker.tensorParallel.size is 4 with nodes 1 in a LeaderWorkerSet" \
      --set worker.tensorParallel.size=4,worker.leaderWorkerSet.enabled=true
    check "worker.tensorParallel.nodes is 2 with backend cuda: $pods_cuda" \
      --set worker.tensorParallel.nodes=2,worker.leaderWorkerSet.enabled=true
    check "worker.tensorParallel.nodes is 2 with backend cuda: $pods_cuda" -f "$here/values-tp-multinode.yaml"
    # groups spanning pods on the cpu backend: one rank per pod, a LeaderWorkerSet, LeaderCreated
    tp2='worker.tensorParallel.nodes=2,worker.config.backend=cpu'
    check 'worker.tensorParallel.size is 4 with nodes 2: a group spanning pods runs one rank per pod' \
      --set worker.tensorParallel.size=4,$tp2,worker.leaderWorkerSet.enabled=true
    check 'worker.tensorParallel.size is 1 with nodes 2: a group spanning pods runs one rank per pod' \
      --set $tp2,worker.leaderWorkerSet.enabled=true
    check 'worker.tensorParallel.nodes is 2: a group spanning pods is a LeaderWorkerSet group' \
      --set worker.tensorParallel.size=2,$tp2
    check 'worker.leaderWorkerSet.startupPolicy LeaderReady cannot start a group spanning 2 pods' \
      --set worker.tensorParallel.size=2,$tp2,worker.leaderWorkerSet.enabled=true,worker.leaderWorkerSet.startupPolicy=LeaderReady
    check 'lifecycle.podDisruptionBudget.minAvailable (2) must be below the lifecycle replica count (2)' \
      --set lifecycle.podDisruptionBudget.minAvailable=2
    check 'gateway.podDisruptionBudget.minAvailable (2) must be below the gateway replica count (2)' \
      --set gateway.podDisruptionBudget.minAvailable=2
    check 'tls.secretName: the Secret with tls.crt, tls.key and ca.crt' --set tls.enabled=true
    check 'gateway.enabled needs lifecycle.headlessService.enabled' \
      --set lifecycle.headlessService.enabled=false
    check 'gateway.httpRoute.enabled needs gateway.httpRoute.parentRefs' \
      --set gateway.httpRoute.enabled=true
    check 'Kubernetes v1.26.0 is too old for this chart: it needs 1.27 or newer' \
      --kube-version 1.26.0
    exit $rc
    ;;

  metric-names)
    # docs/operators.md's table is what the services serve (integration/test_services scrapes a
    # cluster against it), so a name outside it is a rule or a panel that never shows data.
    listed=$(sed -n 's/^| `\(pie_[a-z0-9_]*\)` |.*/\1/p' "$here/../../docs/operators.md" | sort -u)
    [ -n "$listed" ] || { echo "FAIL: no metric table in docs/operators.md"; exit 1; }
    rc=0
    for f in "$chart"/templates/*.yaml "$chart"/templates/*/*.yaml "$chart"/dashboards/*.json; do
      for m in $(grep -o 'pie_[a-z0-9_]*' "$f" | sed 's/_\(bucket\|sum\|count\)$//' | sort -u); do
        grep -qx -- "$m" <<<"$listed" || { echo "FAIL: ${f#"$chart"/} reads $m, which no service serves (not in docs/operators.md)"; rc=1; }
      done
    done
    [ $rc = 0 ] && echo "ok: every pie_* name the chart reads is a served family"
    exit $rc
    ;;

  schema-current)
    python3 "$here/gen-values-schema.py" --check "$1"
    ;;

  validator-selftest)
    need_tools
    out=$(node "$here/validate-manifests.js" --deps "$deps" "$here/broken/manifests.yaml" || true)
    rc=0
    while IFS= read -r want; do
      [ -n "$want" ] || continue
      if grep -qF -- "$want" <<<"$out"; then echo "caught: $want"; else echo "MISSED: $want"; rc=1; fi
    done <"$here/broken/manifests.expected"
    [ $rc = 0 ] || { echo "validator output:"; echo "$out"; }
    exit $rc
    ;;

  dockerfile-lint)
    need_tools
    df="$root/deploy/docker/Dockerfile"
    rc=0
    echo "== dockerfile-utils lint (syntax and semantics, the VS Code Docker language service's checks)"
    "$deps/node_modules/.bin/dockerfile-utils" lint "$df" || rc=1
    echo "== dockerfilelint (best practices)"
    "$deps/node_modules/.bin/dockerfilelint" "$df" || rc=1
    echo "== project rules (tests/deploy/check-dockerfile.py)"
    python3 "$here/check-dockerfile.py" --root "$root" --chart-values "$chart/values.yaml" "$df" || rc=1
    exit $rc
    ;;

  dockerfile-selftest)
    out=$(python3 "$here/check-dockerfile.py" --root "$root" "$here/broken/Dockerfile" || true)
    rc=0
    while IFS= read -r want; do
      [ -n "$want" ] || continue
      if grep -qF -- "$want" <<<"$out"; then echo "caught: $want"; else echo "MISSED: $want"; rc=1; fi
    done <"$here/broken/Dockerfile.expected"
    [ $rc = 0 ] || { echo "checker output:"; echo "$out"; }
    exit $rc
    ;;

  dockerfile-configure)
    exec python3 "$here/dockerfile-configure.py" --root "$root" "$root/deploy/docker/Dockerfile"
    ;;

  runtime-deps)
    bin=$1
    command -v dpkg >/dev/null || { echo "skipped: no dpkg (not a Debian-family host)"; exit 77; }
    for svc in controller lifecycle worker gateway; do
      pkgs=$(sh "$root/deploy/docker/runtime-deps.sh" "$bin/pie-$svc" "$bin/piectl")
      # Every service links gRPC, protobuf-c and libyaml: their packages must be found.
      # ... and the gateway its HTTP server, libmicrohttpd.
      for want in libgrpc29 libprotobuf-c1 libyaml-0-2 $([ "$svc" = gateway ] && echo libmicrohttpd12); do
        grep -qx "$want" <<<"$pkgs" || die "runtime-deps.sh: $want missing for pie-$svc: $(echo $pkgs)"
      done
      echo "ok: pie-$svc + piectl need $(echo $pkgs)"
    done
    ;;

  *)
    sed -n '2,27p' "$0" >&2
    exit 2
    ;;
esac
