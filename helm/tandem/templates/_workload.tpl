{{/*
One Deployment shape for both tiers: the same image, pod security, model volume, drain and
probes; each tier brings its own arguments, ports, volumes and probe handler through the
"tandem.<component>.*" templates. Called with (dict "root" $ "component" "prefill"|"decode").
*/}}
{{- define "tandem.deployment" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $tier := index $root.Values $component -}}
{{- $ctx := dict "root" $root "component" $component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include (printf "tandem.%s.fullname" $component) $root }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
spec:
  {{- if not $tier.autoscaling.enabled }}
  replicas: {{ $tier.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml $tier.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" $ctx | nindent 8 }}
        {{- with $tier.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # A changed model, dtype or block size must restart both tiers together.
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $tier.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      # The servers never talk to the Kubernetes API.
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ include "tandem.terminationGracePeriodSeconds" $root }}
      {{- with $tier.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if $root.Values.model.fetch.enabled }}
      initContainers:
        - name: fetch-model
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args: ["fetch-model", "--home", {{ $root.Values.model.storage.mountPath | quote }}]
          env:
            - name: HOME
              value: /tmp
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml $root.Values.model.fetch.resources | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: model
              mountPath: {{ $root.Values.model.storage.mountPath }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args:
            {{- include (printf "tandem.%s.args" $component) $root | nindent 12 }}
            {{- with $tier.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "tandem.configEnv" $root | trim | nindent 12 }}
            # Caches (Triton, Hugging Face, torch) go to the writable scratch volume.
            - name: HOME
              value: /tmp
            {{- with $tier.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $tier.port }}
              protocol: TCP
            {{- with $tier.httpPort }}
            - name: http
              containerPort: {{ . }}
              protocol: TCP
            {{- end }}
            {{- if $root.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $tier.metricsPort }}
              protocol: TCP
            {{- end }}
            {{- if $tier.kvEvents.enabled }}
            - name: kv-events
              containerPort: {{ $tier.kvEvents.port }}
              protocol: TCP
            - name: kv-replay
              containerPort: {{ $tier.kvEvents.replayPort }}
              protocol: TCP
            {{- end }}
          {{- $handler := include (printf "tandem.%s.probeHandler" $component) $root }}
          # Readiness is SERVING on grpc.health.v1, which the servers report only once warmed up.
          startupProbe:
            {{- $handler | nindent 12 }}
            {{- toYaml $tier.probes.startup | nindent 12 }}
          readinessProbe:
            {{- $handler | nindent 12 }}
            {{- toYaml $tier.probes.readiness | nindent 12 }}
          # The kubelet stops liveness probes once a pod is terminating, so draining
          # (NOT_SERVING) does not get the container killed.
          livenessProbe:
            {{- $handler | nindent 12 }}
            {{- toYaml $tier.probes.liveness | nindent 12 }}
          lifecycle:
            # Lets endpoints and DNS drop the pod before SIGTERM starts the drain.
            preStop:
              sleep:
                seconds: {{ $root.Values.drain.preStopSleepSeconds }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- include "tandem.resources" $tier | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: model
              mountPath: {{ $root.Values.model.storage.mountPath }}
              readOnly: true
            {{- with include (printf "tandem.%s.volumeMounts" $component) $root | trim }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        - name: model
          {{- if eq $root.Values.model.storage.type "persistentVolumeClaim" }}
          persistentVolumeClaim:
            claimName: {{ include "tandem.modelClaimName" $root }}
          {{- else }}
          emptyDir:
            {{- toYaml $root.Values.model.storage.emptyDir | nindent 12 }}
          {{- end }}
        {{- with include (printf "tandem.%s.volumes" $component) $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- with $tier.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := $tier.tolerations }}
      {{- if and $tier.gpu.enabled $tier.gpu.tolerateTaint }}
      {{- $tolerations = append $tolerations (dict "key" $tier.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* CPU/memory as given, plus the GPU count in limits (extended resources cannot overcommit). */}}
{{- define "tandem.resources" -}}
{{- $resources := deepCopy (.resources | default dict) -}}
{{- if .gpu.enabled -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $_ := set $limits .gpu.resourceName (.gpu.count | int) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* The model settings both tiers read from the ConfigMap; args refer to them as $(NAME). */}}
{{- define "tandem.configEnv" -}}
{{- range $key := list "TANDEM_HOME" "TANDEM_MODEL_PATH" "TANDEM_DTYPE" "TANDEM_QUANTIZATION" "TANDEM_BLOCK_SIZE" "TANDEM_KV_CACHE_DTYPE" }}
- name: {{ $key }}
  valueFrom:
    configMapKeyRef:
      name: {{ include "tandem.configName" $ }}
      key: {{ $key }}
{{- end }}
{{- end -}}

{{/*
The kubelet's native gRPC probe speaks plaintext only. When a tier's gRPC port serves TLS,
the probe becomes an exec of a small health client (files/grpc_health_tls.py) that
connects through TLS from inside the pod.
*/}}
{{- define "tandem.tlsProbe" -}}
exec:
  command:
    - python
    - /etc/tandem/probe/grpc_health_tls.py
    - --port
    - {{ .port | quote }}
    - --server-name
    - {{ .serverName | quote }}
    - --ca
    - {{ .ca | quote }}
    {{- if .cert }}
    - --cert
    - {{ .cert | quote }}
    - --key
    - {{ .key | quote }}
    {{- end }}
{{- end -}}

{{- define "tandem.probeScriptVolume" -}}
- name: probe
  configMap:
    name: {{ include "tandem.probeScriptName" . }}
    defaultMode: 0444
{{- end -}}

{{- define "tandem.secretVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secretName }}
    defaultMode: 0440
{{- end -}}
