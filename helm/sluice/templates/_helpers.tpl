{{/*
Chart name, truncated to 63 characters (a DNS label).
*/}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name when it already contains the
chart name. Truncated to 63 characters; "-redis" is appended for the evaluation Redis, so that
name is truncated to 57 first (see sluice.redisName).
*/}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "sluice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of the sluice pods (immutable once installed).
*/}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- end }}

{{/*
ServiceAccount name.
*/}}
{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Container image reference: repository:tag (tag defaults to appVersion), or repository@digest.
*/}}
{{- define "sluice.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Name of the ConfigMap holding the domain files.
*/}}
{{- define "sluice.configMapName" -}}
{{- default (include "sluice.fullname" .) .Values.existingConfigMap }}
{{- end }}

{{/*
ConfigMap key (file name) for a `config` entry: `.yaml` appended unless present.
*/}}
{{- define "sluice.configFileName" -}}
{{- if or (hasSuffix ".yaml" .) (hasSuffix ".yml" .) }}{{ . }}{{ else }}{{ printf "%s.yaml" . }}{{ end }}
{{- end }}

{{/*
Evaluation Redis: name (Deployment and Service), labels and selector labels. Its pods carry
app.kubernetes.io/name=<name>-redis, so the sluice selector never matches them.
*/}}
{{- define "sluice.redisName" -}}
{{- printf "%s-redis" (include "sluice.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "sluice.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "sluice.name" . | trunc 57 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "sluice.redisLabels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
{{ include "sluice.redisSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.redis.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- end }}

{{/*
REDIS_URL for the selected store; empty for the memory store.
*/}}
{{- define "sluice.redisUrl" -}}
{{- if eq .Values.store.type "redis" }}
{{- if .Values.redis.enabled }}
{{- printf "%s:6379" (include "sluice.redisName" .) }}
{{- else }}
{{- .Values.store.redis.url }}
{{- end }}
{{- else if eq .Values.store.type "cluster" }}
{{- join "," .Values.store.cluster.seeds }}
{{- end }}
{{- end }}

{{/*
Cross-value checks the JSON schema cannot express. Included by the Deployment.
*/}}
{{- define "sluice.validate" -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (add (int .Values.settings.shutdownGracePeriodSeconds) (int .Values.settings.shutdownDrainDelaySeconds)) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be greater than settings.shutdownGracePeriodSeconds (%d) + settings.shutdownDrainDelaySeconds (%d), or Kubernetes kills sluice before it has drained" (int .Values.terminationGracePeriodSeconds) (int .Values.settings.shutdownGracePeriodSeconds) (int .Values.settings.shutdownDrainDelaySeconds)) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail (printf "autoscaling.maxReplicas (%d) must be at least autoscaling.minReplicas (%d)" (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- end }}
{{- $domains := dict }}
{{- $files := dict }}
{{- if not .Values.existingConfigMap }}
{{- range $name, $cfg := .Values.config }}
{{- $file := include "sluice.configFileName" $name }}
{{- if hasKey $files $file }}
{{- fail (printf "config: entries %q and %q both become the file %q" (get $files $file) $name $file) }}
{{- end }}
{{- $_ := set $files $file $name }}
{{- $doc := $cfg }}
{{- if kindIs "string" $cfg }}
{{- $doc = fromYaml $cfg }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "config.%s: not a YAML document: %s" $name (get $doc "Error")) }}
{{- end }}
{{- end }}
{{- if not $doc.domain }}
{{- fail (printf "config.%s: no `domain`" $name) }}
{{- end }}
{{- $domain := toString $doc.domain }}
{{- if hasKey $domains $domain }}
{{- fail (printf "config: domain %q is defined twice (in %q and %q); each domain must be in one file" $domain (get $domains $domain) $name) }}
{{- end }}
{{- $_ := set $domains $domain $name }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Probe action: gRPC health (service "ratelimit") on the gRPC port, GET /healthcheck on the named
http port, or (liveness only) a TCP connect to the gRPC port. Takes a dict with "type" and
"grpcPort" (a gRPC probe needs a number).
*/}}
{{- define "sluice.probeAction" -}}
{{- if eq .type "grpc" }}
grpc:
  port: {{ .grpcPort }}
  service: ratelimit
{{- else if eq .type "tcp" }}
tcpSocket:
  port: grpc
{{- else if eq .type "live" }}
httpGet:
  path: /livez
  port: http
{{- else }}
httpGet:
  path: /healthcheck
  port: http
{{- end }}
{{- end }}

{{/*
decisionLog.maxBytes in bytes (a number, or K, M, G: powers of 1024, as DECISION_LOG_MAX_BYTES
reads them).
*/}}
{{- define "sluice.decisionLogBytes" -}}
{{- $s := upper (toString .) -}}
{{- $digits := regexFind "^[0-9]+" $s -}}
{{- $unit := trimPrefix $digits $s -}}
{{- $m := 1 -}}
{{- if eq $unit "K" }}{{ $m = 1024 }}{{ else if eq $unit "M" }}{{ $m = 1048576 }}{{ else if eq $unit "G" }}{{ $m = 1073741824 }}{{ end -}}
{{- mul (atoi $digits) $m -}}
{{- end }}

{{/*
The decision log's emptyDir size: its cap plus a tenth, for the file being rotated.
*/}}
{{- define "sluice.decisionLogSize" -}}
{{- div (mul (include "sluice.decisionLogBytes" . | int64) 11) 10 -}}
{{- end }}
