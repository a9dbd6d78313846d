{{- define "tokenlane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenlane.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokenlane.labels" -}}
{{ include "tokenlane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The policy's port: the container listens where the policy says. */}}
{{- define "tokenlane.port" -}}
{{- dig "server" "port" 8080 .Values.policy | int -}}
{{- end -}}

{{/* The keys a reload cannot apply: their hash rolls the pods when one changes. */}}
{{- define "tokenlane.restartKeys" -}}
{{- $p := .Values.policy -}}
{{- $server := dig "server" dict $p -}}
{{- $keys := dict
  "server" (pick $server "host" "port" "max_body_bytes" "admin_token_env" "api_keys_env" "shutdown_grace_s")
  "tokenizer_file" (dig "estimate" "tokenizer_file" "" $p)
  "redis_url" (dig "redis" "url" "" $p)
  "configMap" .Values.existingPolicyConfigMap -}}
{{- toJson $keys | sha256sum -}}
{{- end -}}
