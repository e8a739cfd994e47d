{{/*
Names, labels, images, and the one place that decides where credentials come from.
*/}}

{{- define "kernel-farm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-kernel-farm, or the release name alone when it already says kernel-farm. */}}
{{- define "kernel-farm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kernel-farm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kernel-farm.labels" -}}
helm.sh/chart: {{ include "kernel-farm.chart" . }}
{{ include "kernel-farm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kernel-farm
{{- end }}

{{- define "kernel-farm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kernel-farm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "worker") */}}
{{- define "kernel-farm.componentLabels" -}}
{{ include "kernel-farm.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kernel-farm.componentSelector" -}}
{{ include "kernel-farm.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kernel-farm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kernel-farm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag[@digest] of an image value, the tag defaulting to the chart's
appVersion. A digest pins the exact image: a tag can be pushed again, a digest cannot. */}}
{{- define "kernel-farm.image" -}}
{{- $img := index . 0 }}{{- $root := index . 1 }}
{{- $ref := printf "%s:%s" $img.repository (default $root.Chart.AppVersion $img.tag | toString) }}
{{- if $img.digest }}{{- $ref = printf "%s@%s" $ref $img.digest }}{{- end }}
{{- $ref }}
{{- end }}

{{/* Service names of the bundled services. */}}
{{- define "kernel-farm.redis.host" -}}{{ include "kernel-farm.fullname" . }}-redis{{- end }}
{{- define "kernel-farm.minio.host" -}}{{ include "kernel-farm.fullname" . }}-minio{{- end }}
{{- define "kernel-farm.postgresql.host" -}}{{ include "kernel-farm.fullname" . }}-postgresql{{- end }}

{{/* FARM_MINIO_ENDPOINT (not a secret: host and port only). */}}
{{- define "kernel-farm.minio.endpoint" -}}
{{- if .Values.minio.enabled }}
{{- printf "%s:9000" (include "kernel-farm.minio.host" .) }}
{{- else }}
{{- required "minio.enabled is false: set minio.endpoint to the external MinIO (host:port or https://host:port)" .Values.minio.endpoint }}
{{- end }}
{{- end }}

{{/* The name of the Secret holding the credentials: the existing one, or ours. */}}
{{- define "kernel-farm.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- include "kernel-farm.fullname" . }}
{{- end }}
{{- end }}

{{/*
One credential for the Secret the chart creates: the value given, else the one already
in that Secret (so upgrades keep generated passwords), else a random one, generated
only where `lookup` reaches a cluster (helm install/upgrade). Under `helm template`
(Argo CD, Flux, CI renders) lookup finds nothing, and a random value would change on
every render: PostgreSQL, which reads its password once, would then refuse the
ingester. So there the chart fails and says what to set instead.
(list $ "secret-key" .Values.secrets.x length "secrets.x")
*/}}
{{- define "kernel-farm.credential" -}}
{{- $root := index . 0 }}{{- $key := index . 1 }}{{- $given := index . 2 }}{{- $length := index . 3 }}{{- $value := index . 4 }}
{{- if $given }}
{{- $given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (include "kernel-farm.fullname" $root) }}
{{- $data := dict }}
{{- if $existing }}{{- $data = $existing.data | default dict }}{{- end }}
{{- if hasKey $data $key }}
{{- index $data $key | b64dec }}
{{- else if (lookup "v1" "Namespace" "" "kube-system") }}
{{- randAlphaNum $length }}
{{- else }}
{{- fail (printf "%s is empty and no cluster answers lookup (helm template, Argo CD, Flux): a generated credential would change on every render. Set secrets.existingSecret to a Secret you manage, or give %s (and the other credentials) as values" $value $value) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
checksum/secret for the pods: a change of credentials rolls them (env from a Secret is
read only at start). The chart's own Secret is hashed as rendered; an existing Secret
is hashed as lookup finds it (its resourceVersion), so rotating it rolls the pods on the
next upgrade.
*/}}
{{- define "kernel-farm.secretChecksum" -}}
{{- if .Values.secrets.existingSecret }}
{{- $found := lookup "v1" "Secret" .Release.Namespace .Values.secrets.existingSecret }}
{{- printf "%s/%s" .Values.secrets.existingSecret (($found.metadata | default dict).resourceVersion | default "") | sha256sum }}
{{- else }}
{{- include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end }}

{{/* The pod annotations every farm pod carries: config and secret checksums. */}}
{{- define "kernel-farm.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include "kernel-farm.secretChecksum" . }}
{{- end }}

{{/* env entry reading one key of the credentials Secret: (list $ "ENV_NAME" "secret-key"),
or (list $ "ENV_NAME" "secret-key" true) for a key the Secret may lack (empty then) */}}
{{- define "kernel-farm.secretEnv" -}}
{{- $root := index . 0 -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kernel-farm.secretName" $root }}
      key: {{ index . 2 }}
      {{- if and (gt (len .) 3) (index . 3) }}
      optional: true
      {{- end }}
{{- end }}

{{/*
Checks that cannot be written in values.schema.json (they compare values with each other).
*/}}
{{- define "kernel-farm.validate" -}}
{{- $farm := .Values.farm }}
{{- if le (float64 $farm.visibilityTimeout) (float64 $farm.compileHardTimeLimit) }}
{{- fail (printf "farm.visibilityTimeout (%v) must exceed farm.compileHardTimeLimit (%v): otherwise a running compile is delivered to a second worker" $farm.visibilityTimeout $farm.compileHardTimeLimit) }}
{{- end }}
{{- if gt (float64 $farm.compileSoftTimeLimit) (float64 $farm.compileHardTimeLimit) }}
{{- fail (printf "farm.compileSoftTimeLimit (%v) must not exceed farm.compileHardTimeLimit (%v)" $farm.compileSoftTimeLimit $farm.compileHardTimeLimit) }}
{{- end }}
{{- $seen := dict }}
{{- range .Values.workers.pools }}
{{- if hasKey $seen .name }}
{{- fail (printf "workers.pools: the pool name %q is used twice" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- if and (eq (.type | default "cpu") "nvidia") (not .fingerprint) }}
{{- fail (printf "workers.pools[%s]: an nvidia pool must name its fingerprint (farm devices on such a node), so that a pod on a node with another GPU or driver refuses to start instead of serving it" .name) }}
{{- end }}
{{- if and (ne (.type | default "cpu") "nvidia") (hasKey . "gpus") }}
{{- fail (printf "workers.pools[%s]: gpus is only for pools of type nvidia" .name) }}
{{- end }}
{{- $as := .autoscaling | default dict }}
{{- if $as.enabled }}
{{- if not .fingerprint }}
{{- fail (printf "workers.pools[%s]: autoscaling scales on the queue farm.<fingerprint>: set the pool's fingerprint" .name) }}
{{- end }}
{{- if gt (int ($as.minReplicas | default 0)) (int ($as.maxReplicas | default 1)) }}
{{- fail (printf "workers.pools[%s].autoscaling: minReplicas (%v) exceeds maxReplicas (%v)" .name $as.minReplicas $as.maxReplicas) }}
{{- end }}
{{- if and (eq (include "kernel-farm.autoscaler" (list $ .)) "hpa") (eq (int ($as.minReplicas | default 0)) 0) }}
{{- fail (printf "workers.pools[%s].autoscaling.minReplicas is 0, which only KEDA can do (no keda.sh/v1alpha1 API here, or autoscaling.mode hpa): install KEDA or set minReplicas to 1 or more" .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- $keda := false }}
{{- range .Values.workers.pools }}{{- if eq (include "kernel-farm.autoscaler" (list $ .)) "keda" }}{{- $keda = true }}{{- end }}{{- end }}
{{- if and $keda (not .Values.redis.enabled) (not .Values.autoscaling.keda.redis.address) }}
{{- fail "autoscaling with KEDA and an external Redis: set autoscaling.keda.redis.address (host:port) for KEDA's redis scaler" }}
{{- end }}
{{- if and $keda (not .Values.redis.enabled) (not .Values.secrets.existingSecret) .Values.autoscaling.keda.redis.passwordKey (not .Values.secrets.redisPassword) }}
{{- fail "autoscaling with KEDA and an external Redis: KEDA reads the password from the Secret's redis-password: set secrets.redisPassword, or autoscaling.keda.redis.passwordKey to an empty string for a Redis without one" }}
{{- end }}
{{- end }}

{{/* A worker pool's grace period: given, or the hard time limit plus a minute. */}}
{{- define "kernel-farm.workerGrace" -}}
{{- $root := index . 0 }}{{- $pool := index . 1 }}
{{- $hard := $root.Values.farm.compileHardTimeLimit | float64 | ceil | int }}
{{- if hasKey $pool "terminationGracePeriodSeconds" }}
{{- if le (int $pool.terminationGracePeriodSeconds) $hard }}
{{- fail (printf "workers.pools[%s].terminationGracePeriodSeconds (%v) must exceed farm.compileHardTimeLimit (%v), so a stopping worker can finish its running compiles" $pool.name $pool.terminationGracePeriodSeconds $root.Values.farm.compileHardTimeLimit) }}
{{- end }}
{{- int $pool.terminationGracePeriodSeconds }}
{{- else }}
{{- add $hard 60 }}
{{- end }}
{{- end }}

{{/*
The autoscaler of a pool: "keda", "hpa", or "" (none: the pool's replicas count).
(list $ $pool). auto: KEDA where its API is served, else the HPA.
*/}}
{{- define "kernel-farm.autoscaler" -}}
{{- $root := index . 0 }}{{- $pool := index . 1 }}
{{- $as := $pool.autoscaling | default dict }}
{{- if $as.enabled }}
{{- $mode := $root.Values.autoscaling.mode | default "auto" }}
{{- if eq $mode "auto" }}
{{- $mode = ternary "keda" "hpa" ($root.Capabilities.APIVersions.Has "keda.sh/v1alpha1") }}
{{- end }}
{{- $mode }}
{{- end }}
{{- end }}

{{/* Egress to one service, bundled (its pods) or external (the peers given, or any
destination on its port): (list $ "redis" 6379) */}}
{{- define "kernel-farm.egressTo" -}}
{{- $root := index . 0 }}{{- $service := index . 1 }}{{- $port := index . 2 }}
{{- $bundled := (index $root.Values $service).enabled }}
{{- $external := index $root.Values.networkPolicy.external $service }}
- ports:
    - protocol: TCP
      port: {{ $bundled | ternary $port $external.port }}
  {{- if $bundled }}
  to:
    - podSelector:
        matchLabels:
          {{- include "kernel-farm.componentSelector" (dict "root" $root "component" $service) | nindent 10 }}
  {{- else if $external.to }}
  to:
    {{- toYaml $external.to | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Egress to the cluster's DNS (any namespace, port 53). */}}
{{- define "kernel-farm.egressDNS" -}}
- ports:
    - protocol: UDP
      port: 53
    - protocol: TCP
      port: 53
{{- end }}

{{/* Ingress to a farm pod: its metrics port only, from metricsFrom (or anyone). */}}
{{- define "kernel-farm.ingressMetrics" -}}
{{- if .Values.metrics.enabled }}
- ports:
    - protocol: TCP
      port: {{ .Values.metrics.port }}
  {{- with .Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
The MinIO credentials of a farm pod (least privilege, docs/SECURITY.md): a pool's own
user, or the read-only user; with minio.perPoolCredentials false, the one MinIO key.
(list $ "pool-<name>" | "reader")
*/}}
{{- define "kernel-farm.minioEnv" -}}
{{- $root := index . 0 }}{{- $who := index . 1 }}
{{- if $root.Values.minio.perPoolCredentials }}
{{- include "kernel-farm.secretEnv" (list $root "FARM_MINIO_ACCESS_KEY" (printf "minio-%s-access-key" $who)) }}
{{ include "kernel-farm.secretEnv" (list $root "FARM_MINIO_SECRET_KEY" (printf "minio-%s-secret-key" $who)) }}
{{- else }}
{{- include "kernel-farm.secretEnv" (list $root "FARM_MINIO_ACCESS_KEY" "minio-access-key") }}
{{ include "kernel-farm.secretEnv" (list $root "FARM_MINIO_SECRET_KEY" "minio-secret-key") }}
{{- end }}
{{- end }}

{{/*
Signing keys and the private CA of a farm container (signing, caBundle): env entries.
(list $ writer) — a writer (worker) also gets the signing key.
*/}}
{{- define "kernel-farm.trustEnv" -}}
{{- $root := index . 0 }}{{- $writer := index . 1 }}
{{- $sig := $root.Values.signing }}
{{- if $sig.existingSecret }}
{{- if $writer }}
- name: FARM_SIGNING_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $sig.existingSecret }}
      key: {{ $sig.signingKeyKey }}
{{- end }}
- name: FARM_VERIFY_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $sig.existingSecret }}
      key: {{ $sig.verifyKeyKey }}
{{- end }}
{{- include "kernel-farm.caEnv" $root }}
{{- end }}

{{/* The CA bundle's env entries (caBundle.existingSecret), for any container. */}}
{{- define "kernel-farm.caEnv" -}}
{{- if .Values.caBundle.existingSecret }}
- name: SSL_CERT_FILE
  value: /etc/kernel-farm/ca/{{ .Values.caBundle.key }}
- name: PGSSLROOTCERT
  value: /etc/kernel-farm/ca/{{ .Values.caBundle.key }}
{{- end }}
{{- end }}

{{/* The CA bundle's volumeMounts entry (nothing without caBundle.existingSecret). */}}
{{- define "kernel-farm.caMount" -}}
{{- if .Values.caBundle.existingSecret }}
- name: ca-bundle
  mountPath: /etc/kernel-farm/ca
  readOnly: true
{{- end }}
{{- end }}

{{/* The CA bundle's volumes entry. */}}
{{- define "kernel-farm.caVolume" -}}
{{- if .Values.caBundle.existingSecret }}
- name: ca-bundle
  secret:
    secretName: {{ .Values.caBundle.existingSecret }}
    items:
      - key: {{ .Values.caBundle.key }}
        path: {{ .Values.caBundle.key }}
{{- end }}
{{- end }}

{{/* Scale-down behaviour of a pool's HPA (plain, or the one KEDA makes): one pod a
minute after the queue stayed short for autoscaling.keda.cooldownPeriod seconds. */}}
{{- define "kernel-farm.scaleDown" -}}
scaleDown:
  # Scaling down stops pods that may be compiling: slowly.
  stabilizationWindowSeconds: {{ .Values.autoscaling.keda.cooldownPeriod }}
  policies:
    - type: Pods
      value: 1
      periodSeconds: 60
{{- end }}
