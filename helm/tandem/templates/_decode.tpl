{{/* Arguments, volumes and probe of the decode tier (see the CLI contract: tandem serve decode). */}}
{{- define "tandem.decode.args" -}}
{{- $d := .Values.decode -}}
- serve
- decode
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
- {{ $d.port | quote }}
- --http-port
- {{ $d.httpPort | quote }}
{{- with $d.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --metrics-port
- {{ $d.metricsPort | quote }}
- --kv-cache-memory
- {{ $d.kvCacheMemory | quote }}
- --max-num-seqs
- {{ $d.maxNumSeqs | quote }}
- --max-num-batched-tokens
- {{ $d.maxNumBatchedTokens | quote }}
{{- with $d.maxModelLen }}
- --max-model-len
- {{ . | quote }}
{{- end }}
{{- if ne (toString $d.maxPrefillsPerStep) "auto" }}
- --max-prefills-per-step
- {{ $d.maxPrefillsPerStep | quote }}
{{- end }}
- --policy
- {{ $d.policy }}
- --batching
- {{ $d.batching }}
- --threads
- {{ $d.threads | quote }}
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
{{- if .Values.prefixCaching.saltByTenant }}
- --cache-salt-by-tenant
{{- end }}
{{- if $d.kvEvents.enabled }}
- --kv-events-config
- {{ include "tandem.kvEventsConfig" (dict "component" "decode" "tier" $d) | quote }}
{{- end }}
{{- if $d.gpu.enabled }}
- --device
- cuda
{{- end }}
{{- if .Values.prefill.enabled }}
- --prefill
- {{ include "tandem.prefillTarget" . }}
{{- if not (kindIs "invalid" $d.localPrefillThreshold) }}
- --local-prefill-threshold
- {{ $d.localPrefillThreshold | quote }}
{{- end }}
{{- if $d.fallbackLocal }}
- --fallback-local
{{- end }}
{{- if .Values.tls.interTier.enabled }}
- --prefill-tls-ca
- /etc/tandem/tls/prefill-client/ca.crt
- --prefill-tls-cert
- /etc/tandem/tls/prefill-client/tls.crt
- --prefill-tls-key
- /etc/tandem/tls/prefill-client/tls.key
{{- end }}
{{- end }}
{{- if .Values.tls.public.enabled }}
- --tls-cert
- /etc/tandem/tls/public/tls.crt
- --tls-key
- /etc/tandem/tls/public/tls.key
{{- end }}
{{- if .Values.auth.enabled }}
- --auth-token-file
- /etc/tandem/auth/{{ .Values.auth.secretKey }}
{{- end }}
{{- end -}}

{{- define "tandem.decode.volumes" -}}
{{- if and .Values.prefill.enabled .Values.tls.interTier.enabled }}
{{ include "tandem.secretVolume" (dict "name" "tls-prefill-client" "secretName" .Values.tls.interTier.decodeSecretName) }}
{{- end }}
{{- if .Values.tls.public.enabled }}
{{ include "tandem.secretVolume" (dict "name" "tls-public" "secretName" .Values.tls.public.secretName) }}
{{ include "tandem.probeScriptVolume" . }}
{{- end }}
{{- if .Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ .Values.auth.secretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.secretKey }}
        path: {{ .Values.auth.secretKey }}
{{- end }}
{{- end -}}

{{- define "tandem.decode.volumeMounts" -}}
{{- if and .Values.prefill.enabled .Values.tls.interTier.enabled }}
- name: tls-prefill-client
  mountPath: /etc/tandem/tls/prefill-client
  readOnly: true
{{- end }}
{{- if .Values.tls.public.enabled }}
- name: tls-public
  mountPath: /etc/tandem/tls/public
  readOnly: true
- name: probe
  mountPath: /etc/tandem/probe
  readOnly: true
{{- end }}
{{- if .Values.auth.enabled }}
- name: auth
  mountPath: /etc/tandem/auth
  readOnly: true
{{- end }}
{{- end -}}

{{/* With TLS on the public port the probe verifies with ca.crt when present, else the system roots. */}}
{{- define "tandem.decode.probeHandler" -}}
{{- if .Values.tls.public.enabled -}}
{{ include "tandem.tlsProbe" (dict "port" .Values.decode.port "serverName" (include "tandem.decodeServerName" .) "ca" "/etc/tandem/tls/public/ca.crt") }}
{{- else -}}
grpc:
  port: {{ .Values.decode.port }}
{{- end -}}
{{- end -}}
