{{/* Arguments, volumes and probe of the prefill tier (see the CLI contract: tandem serve prefill). */}}
{{- define "tandem.prefill.args" -}}
{{- $p := .Values.prefill -}}
- serve
- prefill
- --model
- $(TANDEM_MODEL_PATH)
- --dtype
- $(TANDEM_DTYPE)
- --quantization
- $(TANDEM_QUANTIZATION)
- --block-size
- $(TANDEM_BLOCK_SIZE)
- --kv-cache-dtype
- $(TANDEM_KV_CACHE_DTYPE)
- --host
- 0.0.0.0
- --port
- {{ $p.port | quote }}
- --metrics-port
- {{ $p.metricsPort | quote }}
- --kv-cache-memory
- {{ $p.kvCacheMemory | quote }}
- --max-num-batched-tokens
- {{ $p.maxNumBatchedTokens | quote }}
- --max-queue
- {{ $p.maxQueue | quote }}
- --threads
- {{ $p.threads | quote }}
- --drain-grace-seconds
- {{ .Values.drain.drainGraceSeconds | quote }}
- --log-format
- {{ .Values.logFormat }}
{{- with .Values.tracing.otlpTracesEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- if not .Values.prefixCaching.enabled }}
- --no-prefix-caching
{{- end }}
{{- if $p.kvEvents.enabled }}
- --kv-events-config
- {{ include "tandem.kvEventsConfig" (dict "component" "prefill" "tier" $p) | quote }}
{{- end }}
{{- if $p.gpu.enabled }}
- --device
- cuda
{{- end }}
{{- if .Values.tls.interTier.enabled }}
- --tls-cert
- /etc/tandem/tls/server/tls.crt
- --tls-key
- /etc/tandem/tls/server/tls.key
- --tls-client-ca
- /etc/tandem/tls/server/ca.crt
{{- end }}
{{- end -}}

{{/* The probe presents decode's client certificate: prefill only accepts mTLS callers. */}}
{{- define "tandem.prefill.volumes" -}}
{{- if .Values.tls.interTier.enabled -}}
{{ include "tandem.secretVolume" (dict "name" "tls-server" "secretName" .Values.tls.interTier.prefillSecretName) }}
{{ include "tandem.secretVolume" (dict "name" "tls-probe-client" "secretName" .Values.tls.interTier.decodeSecretName) }}
{{ include "tandem.probeScriptVolume" . }}
{{- end -}}
{{- end -}}

{{- define "tandem.prefill.volumeMounts" -}}
{{- if .Values.tls.interTier.enabled -}}
- name: tls-server
  mountPath: /etc/tandem/tls/server
  readOnly: true
- name: tls-probe-client
  mountPath: /etc/tandem/tls/probe-client
  readOnly: true
- name: probe
  mountPath: /etc/tandem/probe
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "tandem.prefill.probeHandler" -}}
{{- if .Values.tls.interTier.enabled -}}
{{ include "tandem.tlsProbe" (dict "port" .Values.prefill.port "serverName" (include "tandem.prefillServerName" .) "ca" "/etc/tandem/tls/server/ca.crt" "cert" "/etc/tandem/tls/probe-client/tls.crt" "key" "/etc/tandem/tls/probe-client/tls.key") }}
{{- else -}}
grpc:
  port: {{ .Values.prefill.port }}
{{- end -}}
{{- end -}}
