{{/* Names: every resource is <fullname>-<component> so both tiers sit side by side. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Leave room for the longest suffix ("-decode-headless") within the 63-character limit. */}}
{{- define "tandem.base" -}}
{{- include "tandem.fullname" . | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.prefill.fullname" -}}{{ include "tandem.base" . }}-prefill{{- end -}}
{{- define "tandem.decode.fullname" -}}{{ include "tandem.base" . }}-decode{{- end -}}
{{- define "tandem.decode.headlessName" -}}{{ include "tandem.base" . }}-decode-headless{{- end -}}
{{- define "tandem.configName" -}}{{ include "tandem.base" . }}-config{{- end -}}
{{- define "tandem.probeScriptName" -}}{{ include "tandem.base" . }}-probe{{- end -}}
{{- define "tandem.epp.fullname" -}}{{ include "tandem.base" . }}-epp{{- end -}}
{{- define "tandem.modelClaimName" -}}
{{- .Values.model.storage.persistentVolumeClaim.existingClaim | default (printf "%s-model" (include "tandem.base" .)) -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels are immutable on a Deployment: keep them to name, instance, component. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "tandem.modelPath" -}}
{{- .Values.model.path | default (printf "%s/models/%s" .Values.model.storage.mountPath .Values.model.name) -}}
{{- end -}}

{{/* The headless prefill Service in gRPC's DNS-resolver syntax: decode balances over every A record. */}}
{{- define "tandem.prefillTarget" -}}
dns:///{{ include "tandem.prefill.fullname" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.prefill.port }}
{{- end -}}

{{- define "tandem.prefillServerName" -}}
{{ include "tandem.prefill.fullname" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}
{{- end -}}

{{- define "tandem.decodeServerName" -}}
{{- .Values.tls.public.serverName | default (printf "%s.%s.svc.%s" (include "tandem.decode.fullname" .) .Release.Namespace .Values.clusterDomain) -}}
{{- end -}}

{{- define "tandem.terminationGracePeriodSeconds" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.drainGraceSeconds .Values.drain.terminationBufferSeconds -}}
{{- end -}}

{{- define "tandem.anyTLS" -}}
{{- if or .Values.tls.interTier.enabled .Values.tls.public.enabled -}}true{{- end -}}
{{- end -}}

{{/* The chart runs the endpoint picker only for its own InferencePool, and never when one is named. */}}
{{- define "tandem.epp.deployed" -}}
{{- $picker := .Values.inferencePool.endpointPicker -}}
{{- if and .Values.inferencePool.enabled $picker.deploy (not $picker.name) -}}true{{- end -}}
{{- end -}}

{{/*
vLLM's KVEventsConfig as JSON for --kv-events-config: a ZMQ publisher bound on every interface, with
its replay socket. Called with (dict "component" "decode"|"prefill" "tier" <tier values>).
*/}}
{{- define "tandem.kvEventsConfig" -}}
{{- $kv := .tier.kvEvents -}}
{{- $taken := dict (toString .tier.port) "port" (toString .tier.metricsPort) "metricsPort" -}}
{{- with .tier.httpPort }}{{ $_ := set $taken (toString .) "httpPort" }}{{ end -}}
{{- range $key := list "port" "replayPort" }}
{{- $number := toString (index $kv $key) }}
{{- if hasKey $taken $number }}
{{- fail (printf "%s.kvEvents.%s %s is already %s.%s: the KV event sockets need ports of their own" $.component $key $number $.component (get $taken $number)) }}
{{- end }}
{{- $_ := set $taken $number (printf "kvEvents.%s" $key) }}
{{- end -}}
{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": {{ printf "tcp://*:%d" (int $kv.port) | toJson }}, "replay_endpoint": {{ printf "tcp://*:%d" (int $kv.replayPort) | toJson }}, "topic": {{ $kv.topic | toJson }}}
{{- end -}}
