{{/* The tiers this release deploys: decode always, prefill unless running aggregated. */}}
{{- define "tandem.components" -}}
{{- if .Values.prefill.enabled }}prefill {{ end }}decode
{{- end -}}
