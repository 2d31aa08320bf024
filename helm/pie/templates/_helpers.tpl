{{/*
Names, labels and shared fragments of the Pie-C chart.
*/}}

{{/* Chart name, overridable. */}}
{{- define "pie.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name.
Truncated to 40 characters so that "<fullname>-lifecycle-headless" and the pod names of the
worker StatefulSet stay within DNS label limits. */}}
{{- define "pie.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pie.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Recommended labels (app.kubernetes.io/*) common to every object. */}}
{{- define "pie.labels" -}}
helm.sh/chart: {{ include "pie.chart" . }}
app.kubernetes.io/name: {{ include "pie.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pie
{{- end -}}

{{/* Selector labels of one component: include "pie.selectorLabels" (dict "ctx" $ "component" "worker") */}}
{{- define "pie.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pie.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. */}}
{{- define "pie.componentLabels" -}}
{{ include "pie.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image reference of a component: include "pie.image" (dict "ctx" $ "repository" "pie-worker") */}}
{{- define "pie.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .ctx.Values.image.tag -}}
{{- if .ctx.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .ctx.Values.image.registry) .repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "pie.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pie.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when a cluster answers lookups (helm install/upgrade), "" for offline renders (helm
template, GitOps tools), where every lookup is empty. Either a cluster-scoped read (the
kube-system Namespace) or a namespaced one (the release namespace's Secrets, which a
namespace-scoped installer can read) proves it. */}}
{{- define "pie.online" -}}
{{- if or (lookup "v1" "Namespace" "" "kube-system") (lookup "v1" "Secret" .Release.Namespace "") -}}true{{- end -}}
{{- end -}}

{{- define "pie.authSecretName" -}}
{{- default (printf "%s-auth" (include "pie.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Object names. */}}
{{- define "pie.controller.fullname" -}}{{ include "pie.fullname" . }}-controller{{- end -}}
{{- define "pie.lifecycle.fullname" -}}{{ include "pie.fullname" . }}-lifecycle{{- end -}}
{{- define "pie.worker.fullname" -}}{{ include "pie.fullname" . }}-worker{{- end -}}
{{- define "pie.gateway.fullname" -}}{{ include "pie.fullname" . }}-gateway{{- end -}}

{{/* Fully qualified DNS name of a Service in the release namespace. */}}
{{- define "pie.svcFQDN" -}}
{{- printf "%s.%s.svc.%s" .name .ctx.Release.Namespace .ctx.Values.clusterDomain -}}
{{- end -}}

{{/* The address workers and lifecycle replicas dial (controller.address). */}}
{{- define "pie.controller.address" -}}
{{- printf "%s:%d" (include "pie.svcFQDN" (dict "ctx" . "name" (include "pie.controller.fullname" .))) (int .Values.controller.port) -}}
{{- end -}}

{{/* The gRPC target the gateways dial (lifecycle.address): the lifecycle's headless Service
through the dns resolver, so each gateway resolves every ready lifecycle pod and spreads its
calls over them round-robin, with client-side health checks (a ClusterIP Service would pin
each gateway to one pod: a gRPC client keeps one connection). */}}
{{- define "pie.gateway.lifecycleAddress" -}}
{{- if not .Values.lifecycle.headlessService.enabled -}}
{{- fail "gateway.enabled needs lifecycle.headlessService.enabled: the gateway dials dns:///<lifecycle headless Service> to spread requests over every lifecycle pod (set gateway.enabled=false, or keep the headless Service)" -}}
{{- end -}}
{{- printf "dns:///%s:%d" (include "pie.svcFQDN" (dict "ctx" . "name" (printf "%s-headless" (include "pie.lifecycle.fullname" .)))) (int .Values.lifecycle.port) -}}
{{- end -}}

{{/* Where the auth token file is mounted. */}}
{{- define "pie.tokenDir" -}}/var/run/secrets/pie{{- end -}}
{{/* Where the TLS Secret (tls.crt, tls.key, ca.crt) is mounted. */}}
{{- define "pie.tlsDir" -}}/var/run/secrets/pie-tls{{- end -}}

{{/* Rendered service configuration: the values' config merged with the keys the chart owns.
include "pie.config" (dict "ctx" $ "svc" .Values.worker "extra" (dict ...))
"grpcPort" overrides svc.port for server.listen; "noAuth" true leaves auth.* out (the gateway
holds no token: it forwards each client's). */}}
{{- define "pie.config" -}}
{{- $managed := dict "server" (dict "listen" (printf "0.0.0.0:%d" (int (default .svc.port .grpcPort)))) "metrics" (dict "listen" (printf "0.0.0.0:%d" (int .svc.metricsPort))) -}}
{{- if and .ctx.Values.auth.enabled (not .noAuth) -}}
{{- $_ := set $managed "auth" (dict "token_file" (printf "%s/%s" (include "pie.tokenDir" .ctx) .ctx.Values.auth.secretKey)) -}}
{{- end -}}
{{- if .ctx.Values.tls.enabled -}}
{{- $d := include "pie.tlsDir" .ctx -}}
{{- $_ := set $managed "tls" (dict "cert_file" (printf "%s/tls.crt" $d) "key_file" (printf "%s/tls.key" $d) "ca_file" (printf "%s/ca.crt" $d)) -}}
{{- end -}}
{{- $cfg := mustMergeOverwrite (deepCopy (default (dict) .svc.config)) $managed (default (dict) .extra) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Bytes of a Kubernetes quantity: digits, at most 6 after a decimal point, with an optional
suffix (Ki Mi Gi Ti, k M G T), e.g. "2Gi" -> 2147483648, "1.5Gi" -> 1610612736 (a fraction of a
byte rounded down). Anything else (exponents, milli) fails the render, naming the value.
include "pie.quantityBytes" (dict "q" .Values.lifecycle.cacheSizeLimit "what" "lifecycle.cacheSizeLimit") */}}
{{- define "pie.quantityBytes" -}}
{{- $q := toString .q -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- $n := regexFind "^[0-9]+(\\.[0-9]{1,6})?" $q -}}
{{- $suffix := trimPrefix $n $q -}}
{{- if or (not $n) (not (hasKey $units $suffix)) -}}
{{- fail (printf "%s: %q is not a quantity the chart can read (digits, at most 6 after a point, and Ki, Mi, Gi, Ti, k, M, G or T)" .what $q) -}}
{{- end -}}
{{- $whole := regexFind "^[0-9]+" $n -}}
{{- $frac := trimPrefix "." (trimPrefix $whole $n) -}}
{{- $unit := get $units $suffix | int64 -}}
{{- $bytes := mul (atoi $whole | int64) $unit -}}
{{- if $frac -}}
{{- /* the fraction's bytes, rounded down: 1.5Gi = 1 Gi + 5 * Gi / 10 */ -}}
{{- $bytes = add $bytes (div (mul (atoi $frac | int64) $unit) (atoi (printf "1%s" (repeat (len $frac) "0")) | int64)) -}}
{{- end -}}
{{- $bytes -}}
{{- end -}}

{{/* Pod annotations shared by the components: Prometheus scrape hints and the config checksum.
include "pie.podAnnotations" (dict "ctx" $ "svc" .Values.worker "config" "worker/configmap.yaml") */}}
{{- define "pie.podAnnotations" -}}
checksum/config: {{ include (print .ctx.Template.BasePath "/" .config) .ctx | sha256sum }}
{{- if .ctx.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .svc.metricsPort | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .svc.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Native gRPC probes against grpc.health.v1 (numeric port; "" = the whole server).
include "pie.grpcProbe" (dict "tls" $.Values.tls "port" 50053 "service" "" "p" .Values.worker.startupProbe) */}}
{{- define "pie.grpcProbe" -}}
{{- /* Kubernetes' gRPC probes speak plaintext: with TLS, piectl asks the same health over TLS. */ -}}
{{- if .tls.enabled -}}
exec:
  command:
    - /usr/local/bin/piectl
    - --tls-ca
    - {{ include "pie.tlsDir" . }}/ca.crt
    - --timeout
    - {{ mul (int .p.timeoutSeconds) 1000 | quote }}
    - --addr
    - localhost:{{ int .port }}
    - --service
    - {{ .service | quote }}
    - health
{{- else -}}
grpc:
  port: {{ int .port }}
  service: {{ .service | quote }}
{{- end }}
periodSeconds: {{ int .p.periodSeconds }}
timeoutSeconds: {{ int .p.timeoutSeconds }}
failureThreshold: {{ int .p.failureThreshold }}
{{- end -}}

{{/* HTTP probe (the gateway's /healthz and /readyz on its named port "http").
include "pie.httpProbe" (dict "path" "/readyz" "p" .Values.gateway.readinessProbe) */}}
{{- define "pie.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: http
  scheme: HTTP
periodSeconds: {{ int .p.periodSeconds }}
timeoutSeconds: {{ int .p.timeoutSeconds }}
failureThreshold: {{ int .p.failureThreshold }}
{{- end -}}

{{/* Volumes and mounts every service pod has: its config, the token, a writable /tmp.
"noAuth" true: no token volume (the gateway). */}}
{{- define "pie.commonVolumes" -}}
- name: config
  configMap:
    name: {{ .configMap }}
{{- if and .ctx.Values.auth.enabled (not .noAuth) }}
- name: auth
  secret:
    secretName: {{ include "pie.authSecretName" .ctx }}
    defaultMode: 288 # 0440: owner and group (fsGroup) read
    items:
      - key: {{ .ctx.Values.auth.secretKey }}
        path: {{ .ctx.Values.auth.secretKey }}
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName: the Secret with tls.crt, tls.key and ca.crt (e.g. from cert-manager) is required with tls.enabled" .ctx.Values.tls.secretName }}
    defaultMode: 288 # 0440
{{- end }}
{{- with (.svc | default dict).extraVolumes }}
{{ toYaml . }}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
{{- end -}}

{{- define "pie.commonMounts" -}}
- name: config
  mountPath: /etc/pie
  readOnly: true
{{- if and .ctx.Values.auth.enabled (not .noAuth) }}
- name: auth
  mountPath: {{ include "pie.tokenDir" .ctx }}
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- if .ctx.Values.tls.enabled }}
- name: tls
  mountPath: {{ include "pie.tlsDir" .ctx }}
  readOnly: true
{{- end }}
{{- with (.svc | default dict).extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A container's own environment entries beyond the chart's (extraEnv; the worker's nccl map
as NCCL_* variables), then its envFrom. include "pie.extraEnvItems" $svc inside an env list;
include "pie.envFrom" $svc at the container level. */}}
{{- define "pie.extraEnvItems" -}}
{{- range $k, $v := (.nccl | default dict) }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- define "pie.envFrom" -}}
{{- with .envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The preStop hook of lifecycle and worker containers (argument: the component's values).
Kubernetes runs it before SIGTERM: the pod leaves its Services' endpoints and clients' balancers
while it still accepts work; SIGTERM then starts the drain (docs/operators.md, "Shutdown"), which
takes up to server.shutdown_grace. terminationGracePeriodSeconds counts from the hook's start,
so it must cover preStopSleepSeconds + server.shutdown_grace + a margin (tests/deploy/
check-wiring.js checks it). */}}
{{- define "pie.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ int .preStopSleepSeconds }}"]
{{- end -}}

{{/* Pod-level fields shared by every component. enableServiceLinks is off: Kubernetes would
otherwise inject variables such as PIE_CONTROLLER_PORT=tcp://... for the Services named
pie-controller etc., inside the services' own PIE_* configuration namespace. */}}
{{- define "pie.podCommon" -}}
serviceAccountName: {{ include "pie.serviceAccountName" .ctx }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .ctx.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if .svc.hostIPC }}
# NCCL and CUDA IPC between the GPUs of the pod use the host's IPC namespace.
hostIPC: true
{{- end }}
{{- with .svc.initContainers }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ int .svc.terminationGracePeriodSeconds }}
{{- with .svc.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Refuses worker groups that cannot form. On the cpu backend a group of tensorParallel.size
ranks runs in one pod (one pie-worker forks the ranks; they share a collective in /dev/shm) or,
with nodes = size, as a LeaderWorkerSet group of pods, one rank each (ranks join rank 0 over
Worker/TpJoin and compute over a TCP collective on tensorParallel.port: docs/tensor-parallel.md).
A cuda group of size ranks in one pod (nodes 1) requests size GPUs; pie-worker forks one rank
per GPU (each rank's CUDA_VISIBLE_DEVICES one of the pod's) and the ranks use NCCL over the
pod's /dev/shm (worker.shmSizeLimit). cuda groups spanning pods are refused: NCCL's bootstrap
and transport ports between the pods are not wired. */}}
{{- define "pie.worker.checkTensorParallel" -}}
{{- $size := int .Values.worker.tensorParallel.size -}}
{{- $nodes := int .Values.worker.tensorParallel.nodes -}}
{{- $backend := include "pie.worker.backend" . -}}
{{- $lws := .Values.worker.leaderWorkerSet -}}
{{- if and (gt $nodes 1) (ne $backend "cpu") -}}
{{- fail (printf "worker.tensorParallel.nodes is %d with backend %s: groups spanning pods run on the cpu backend only so far (cuda groups across pods also need NCCL's bootstrap and transport ports open between the pods, which the chart does not wire yet); set worker.config.backend=cpu, or worker.tensorParallel.nodes=1 and size=1 and scale out with worker.replicas (docs/tensor-parallel.md)" $nodes $backend) -}}
{{- end -}}
{{- if and (gt $nodes 1) (ne $size $nodes) -}}
{{- fail (printf "worker.tensorParallel.size is %d with nodes %d: a group spanning pods runs one rank per pod, so size must equal nodes (pie-worker refuses another tp.size in a LeaderWorkerSet group); set worker.tensorParallel.size=%d, or nodes=1 for a group of %d ranks in one pod" $size $nodes $nodes $size) -}}
{{- end -}}
{{- if and (gt $nodes 1) (not $lws.enabled) -}}
{{- fail (printf "worker.tensorParallel.nodes is %d: a group spanning pods is a LeaderWorkerSet group (one pod per rank); set worker.leaderWorkerSet.enabled=true (the LeaderWorkerSet controller must be installed)" $nodes) -}}
{{- end -}}
{{- if and (gt $size 1) (eq $nodes 1) $lws.enabled -}}
{{- fail (printf "worker.tensorParallel.size is %d with nodes 1 in a LeaderWorkerSet: a group in one pod is that pod's pie-worker forking its ranks, and a LeaderWorkerSet group of one pod gives it nothing; set worker.leaderWorkerSet.enabled=false, or nodes=%d for one rank per pod (backend cpu)" $size $size) -}}
{{- end -}}
{{- if and (gt $nodes 1) (eq $lws.startupPolicy "LeaderReady") -}}
{{- fail (printf "worker.leaderWorkerSet.startupPolicy LeaderReady cannot start a group spanning %d pods: the leader (rank 0) turns ready only once every rank joined it, and LeaderReady creates the other ranks only after that; use LeaderCreated" $nodes) -}}
{{- end -}}
{{- if and (gt $size 1) (ne $backend "cpu") (ne $backend "cuda") -}}
{{- fail (printf "worker.tensorParallel.size is %d with backend %s: tensor-parallel groups run on the cpu and cuda backends; set worker.config.backend, or worker.tensorParallel.size=1 and scale out with worker.replicas (docs/tensor-parallel.md)" $size $backend) -}}
{{- end -}}
{{- end -}}

{{/* The worker's compute backend (its `backend` key): worker.config.backend when set, else
cuda. The chart always writes it: the binary's own default, cpu, would leave the GPU a worker
pod requests idle. */}}
{{- define "pie.worker.backend" -}}
{{- default "cuda" .Values.worker.config.backend -}}
{{- end -}}

{{/* GPUs per worker pod: one per rank with backend cuda (one rank today), none otherwise. */}}
{{- define "pie.worker.gpusPerPod" -}}
{{- include "pie.worker.checkTensorParallel" . -}}
{{- if eq (include "pie.worker.backend" .) "cuda" -}}
{{- div (int .Values.worker.tensorParallel.size) (int .Values.worker.tensorParallel.nodes) -}}
{{- else -}}
0
{{- end -}}
{{- end -}}

{{/* The worker's tp section: size, and the collective's port for a group spanning pods. */}}
{{- define "pie.worker.tpConfig" -}}
size: {{ int .Values.worker.tensorParallel.size }}
{{- if gt (int .Values.worker.tensorParallel.nodes) 1 }}
port: {{ int .Values.worker.tensorParallel.port }}
{{- end }}
{{- end -}}

{{/* Whether the workers are a LeaderWorkerSet (groups of tensorParallel.nodes pods). */}}
{{- define "pie.worker.lws" -}}
{{- include "pie.worker.checkTensorParallel" . -}}
{{- if .Values.worker.leaderWorkerSet.enabled -}}
true
{{- end -}}
{{- end -}}
