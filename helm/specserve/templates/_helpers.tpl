{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart, or the release name when it already holds the chart name. */}}
{{- define "specserve.fullname" -}}
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

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: server
app.kubernetes.io/part-of: specserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference; the default tag is appVersion, with "-gpu" for the CUDA image. */}}
{{- define "specserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "-gpu" "" (eq .Values.devices "gpu"))) }}
{{- printf "%s:%s" .Values.image.repository (toString $tag) }}
{{- end }}

{{/* Resources: .Values.resources when set, else the preset for .Values.devices. */}}
{{- define "specserve.resources" -}}
{{- if .Values.resources }}
{{- toYaml .Values.resources }}
{{- else }}
{{- toYaml (index .Values.resourcePresets .Values.devices) }}
{{- end }}
{{- end }}

{{- define "specserve.cacheClaimName" -}}
{{- .Values.cache.persistence.existingClaim | default (printf "%s-cache" (include "specserve.fullname" .)) }}
{{- end }}

{{/* `specserve serve` flags from values, one "--flag=value" item each (a YAML list). */}}
{{- define "specserve.args" -}}
{{- $m := .Values.model }}
{{- $d := .Values.draftModel -}}
- "--host=0.0.0.0"
- {{ printf "--port=%v" (.Values.containerPort) | quote }}
- {{ printf "--devices=%v" (.Values.devices) | quote }}
{{- with $m.path }}
- {{ printf "--model-path=%v" (.) | quote }}
{{- end }}
{{- with $m.weightPath }}
- {{ printf "--weight-path=%v" (.) | quote }}
{{- end }}
{{- with $m.quantizationEncoding }}
- {{ printf "--quantization-encoding=%v" (.) | quote }}
{{- end }}
{{- with $m.servedModelName }}
- {{ printf "--served-model-name=%v" (.) | quote }}
{{- end }}
{{- if not (kindIs "invalid" $m.maxLength) }}
- {{ printf "--max-length=%v" (int64 $m.maxLength) | quote }}
{{- end }}
{{- if not (kindIs "invalid" $m.maxBatchSize) }}
- {{ printf "--max-batch-size=%v" (int64 $m.maxBatchSize) | quote }}
{{- end }}
{{- with $d.path }}
- {{ printf "--draft-model-path=%v" (.) | quote }}
{{- end }}
{{- with $d.quantizationEncoding }}
- {{ printf "--draft-quantization-encoding=%v" (.) | quote }}
{{- end }}
- {{ printf "--speculative-method=%v" (.Values.speculative.method) | quote }}
{{- if not (kindIs "invalid" .Values.speculative.maxNumSteps) }}
- {{ printf "--max-num-steps=%v" (int64 .Values.speculative.maxNumSteps) | quote }}
{{- end }}
- {{ printf "--device-memory-utilization=%v" (.Values.engine.deviceMemoryUtilization) | quote }}
{{- if .Values.engine.enableChunkedPrefill }}
- "--enable-chunked-prefill"
{{- else }}
- "--no-enable-chunked-prefill"
{{- end }}
{{- if .Values.engine.enablePrefixCaching }}
- "--enable-prefix-caching"
{{- end }}
{{- if not (kindIs "invalid" .Values.engine.numThreads) }}
- {{ printf "--num-threads=%v" (int64 .Values.engine.numThreads) | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.engine.maxKvCacheTokens) }}
- {{ printf "--max-kv-cache-tokens=%v" (int64 .Values.engine.maxKvCacheTokens) | quote }}
{{- end }}
- {{ printf "--log-level=%v" .Values.logging.level | quote }}
- {{ printf "--log-format=%v" .Values.logging.format | quote }}
{{- if not .Values.logging.accessLog }}
- "--no-access-log"
{{- end }}
{{- range .Values.extraArgs }}
- {{ toString . | quote }}
{{- end }}
{{- end }}

{{/* Pod affinity: .Values.affinity, plus (devices=gpu, gpuNodeAffinity.enabled) the GPU node expressions
     ANDed into every required node selector term (one term of their own when there is none). */}}
{{- define "specserve.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- if and (eq .Values.devices "gpu") .Values.gpuNodeAffinity.enabled }}
{{- $node := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := list }}
{{- range (get $required "nodeSelectorTerms" | default (list dict)) }}
{{- $exprs := concat (get . "matchExpressions" | default list) $.Values.gpuNodeAffinity.matchExpressions }}
{{- $terms = append $terms (merge (dict "matchExpressions" $exprs) .) }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- if $affinity }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}

{{/* Topology spread constraints; one without a labelSelector selects this release's pods. */}}
{{- define "specserve.topologySpread" -}}
{{- $out := list }}
{{- range .Values.topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "specserve.selectorLabels" $ | fromYaml)) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}
