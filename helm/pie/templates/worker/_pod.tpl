{{/*
Pod template of a worker: include "pie.worker.podTemplate" (dict "ctx" $ "role" "single"|"leader"|"rank")
  single  one pod per tensor-parallel group (StatefulSet), all of the group's GPUs in the pod
  leader  rank-0 pod of a LeaderWorkerSet group: holds the controller link, serves Worker/TpJoin
          and listens for the group's collective on tensorParallel.port (nodes > 1)
  rank    another pod of a LeaderWorkerSet group: rank $(POD_WORKER_INDEX), joins the leader
*/}}
{{- define "pie.worker.podTemplate" -}}
{{- $ := .ctx -}}
{{- $w := $.Values.worker -}}
{{- $gpus := int (include "pie.worker.gpusPerPod" $) -}}
{{- $name := include "pie.worker.fullname" $ -}}
{{- $spans := gt (int $w.tensorParallel.nodes) 1 -}}
{{- $resources := deepCopy (default (dict) $w.resources) -}}
{{- $limits := default (dict) $resources.limits -}}
{{- $requests := default (dict) $resources.requests -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $limits $w.gpuResource $gpus -}}
{{- $_ := set $requests $w.gpuResource $gpus -}}
{{- end -}}
{{- $_ := set $resources "limits" $limits -}}
{{- $_ := set $resources "requests" $requests -}}
metadata:
  labels:
    {{- include "pie.componentLabels" (dict "ctx" $ "component" "worker") | nindent 4 }}
    {{- if ne .role "single" }}
    pie-tp-role: {{ .role }}
    {{- end }}
    {{- with $w.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "pie.podAnnotations" (dict "ctx" $ "svc" $w "config" "worker/configmap.yaml") | nindent 4 }}
spec:
  {{- include "pie.podCommon" (dict "ctx" $ "svc" $w) | nindent 2 }}
  {{- with $w.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "pie.image" (dict "ctx" $ "repository" $w.image.repository) }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["/usr/local/bin/pie-worker", "--config", "/etc/pie/worker.yaml"]
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- if eq .role "single" }}
        - name: PIE_WORKER_GROUP_ID
          value: "$(POD_NAME)"
        - name: PIE_WORKER_ADVERTISE
          value: "$(POD_NAME).{{ include "pie.svcFQDN" (dict "ctx" $ "name" $name) }}:{{ int $w.port }}"
        {{- else }}
        # Set by the LeaderWorkerSet controller on every pod of a group.
        - name: POD_GROUP_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
        - name: POD_WORKER_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
        - name: PIE_WORKER_GROUP_ID
          value: "{{ $name }}-$(POD_GROUP_INDEX)"
        - name: PIE_WORKER_ADVERTISE
          value: "$(POD_NAME).{{ include "pie.svcFQDN" (dict "ctx" $ "name" $name) }}:{{ int $w.port }}"
        {{- end }}
        # CUDA's JIT cache; the root filesystem is read-only.
        - name: CUDA_CACHE_PATH
          value: /tmp/cuda-cache
        # worker.memory as pie-worker's memory.policy and memory.host_pool (docs/deploy.md,
        # "Forwarded keys").
        - name: PIE_MEMORY_POLICY
          value: {{ $w.memory.policy | quote }}
        - name: PIE_MEMORY_HOST_POOL
          value: {{ $w.memory.hostPool | toString | quote }}
        {{- if and (ne .role "single") $spans }}
        # A group spanning pods, one rank each (what LWS_WORKER_INDEX and LWS_LEADER_ADDRESS
        # say, explicitly): rank 0 serves Worker/TpJoin on its gRPC port, the others join it.
        - name: PIE_TP_RANK
          value: "$(POD_WORKER_INDEX)"
        - name: PIE_TP_LEADER
          value: "{{ $name }}-$(POD_GROUP_INDEX).{{ include "pie.svcFQDN" (dict "ctx" $ "name" $name) }}:{{ int $w.port }}"
        {{- end }}
        {{- with include "pie.extraEnvItems" $w | trim }}{{ . | nindent 8 }}{{ end }}
      {{- with include "pie.envFrom" $w | trim }}{{ . | nindent 6 }}{{ end }}
      ports:
        - name: grpc
          containerPort: {{ int $w.port }}
          protocol: TCP
        - name: metrics
          containerPort: {{ int $w.metricsPort }}
          protocol: TCP
        {{- if and (eq .role "leader") $spans }}
        - name: tp
          containerPort: {{ int $w.tensorParallel.port }}
          protocol: TCP
        {{- end }}
      # SERVING only once the model is loaded: the startup probe allows a long load, the
      # readiness probe keeps a worker without its model out of the Service.
      {{- /* A rank pod of a group spanning pods serves health only, SERVING once its shard is
      loaded in a formed group (the leader: once the whole group is), so the same probes fit. */}}
      startupProbe:
        {{- include "pie.grpcProbe" (dict "tls" $.Values.tls "port" $w.port "service" "" "p" $w.startupProbe) | nindent 8 }}
      readinessProbe:
        {{- include "pie.grpcProbe" (dict "tls" $.Values.tls "port" $w.port "service" "pie.v1.Worker" "p" $w.readinessProbe) | nindent 8 }}
      livenessProbe:
        {{- include "pie.grpcProbe" (dict "tls" $.Values.tls "port" $w.port "service" "" "p" $w.livenessProbe) | nindent 8 }}
      {{- include "pie.preStop" $w | nindent 6 }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      {{- with $.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "pie.commonMounts" (dict "ctx" $ "svc" $w) | nindent 8 }}
        - name: models
          mountPath: {{ $w.model.mountPath }}
          readOnly: true
        - name: dshm
          mountPath: /dev/shm
  volumes:
    {{- include "pie.commonVolumes" (dict "ctx" $ "svc" $w "configMap" $name) | nindent 4 }}
    - name: models
      {{- if $w.model.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $w.model.existingClaim }}
        readOnly: true
      {{- else if $w.model.createClaim.enabled }}
      persistentVolumeClaim:
        claimName: {{ $name }}-models
        readOnly: true
      {{- else }}
      hostPath:
        path: {{ $w.model.hostPath }}
        type: Directory
      {{- end }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSizeLimit }}
{{- end -}}
