{{/*
Names. With the documented release name ("dscache") the objects get the names
of operator/deploy/*.yaml: dscache-controller, dscache-webhook, ...
*/}}
{{- define "dscache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dscache.fullname" -}}
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

{{/* Suffixed names; the base is cut to 52 characters so that "-source-check" still fits in 63. */}}
{{- define "dscache.controller.fullname" -}}
{{- printf "%s-controller" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}
{{- define "dscache.webhook.fullname" -}}
{{- printf "%s-webhook" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}
{{- define "dscache.node.fullname" -}}
{{- printf "%s-node" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}
{{- /* The node agents' serving certificate (agent-tls.yaml). */}}
{{- define "dscache.agentTlsSecret" -}}
{{- printf "%s-agent-tls" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}
{{- define "dscache.uninstall.fullname" -}}
{{- printf "%s-uninstall" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}
{{- define "dscache.webhook.tlsSecret" -}}
{{- printf "%s-webhook-tls" (include "dscache.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}

{{- define "dscache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dscache.labels" -}}
helm.sh/chart: {{ include "dscache.chart" . }}
{{ include "dscache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dscache
{{- end }}

{{- define "dscache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dscache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The node agents' labels: their own app.kubernetes.io/name (<name>-node, by
default dscache-node, what `kubectl get pods -l app.kubernetes.io/name=dscache-node`
and the controller's messages use), so the metrics Service and the operator's
selectors (name <name>) never pick them up by accident.
*/}}
{{- define "dscache.node.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-node" (include "dscache.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node
{{- end }}
{{- define "dscache.node.labels" -}}
helm.sh/chart: {{ include "dscache.chart" . }}
{{ include "dscache.node.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dscache
{{- end }}

{{/* Usage: include "dscache.componentLabels" (list $ "controller") */}}
{{- define "dscache.componentLabels" -}}
{{ include "dscache.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}
{{- define "dscache.componentSelectorLabels" -}}
{{ include "dscache.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Images: [registry/]repository then @digest, or :tag (default: the chart's appVersion). Usage: include "dscache.imageRef" (list $ .Values.image) */}}
{{- define "dscache.imageRef" -}}
{{- $root := index . 0 }}
{{- $img := index . 1 }}
{{- $repo := $img.repository }}
{{- with $img.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}{{ end }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default $root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}
{{- define "dscache.image" -}}
{{- include "dscache.imageRef" (list . .Values.image) }}
{{- end }}
{{- define "dscache.stagerImage" -}}
{{- include "dscache.imageRef" (list . .Values.stager.image) }}
{{- end }}

{{/* ServiceAccount names: the given name, else the generated one. */}}
{{- define "dscache.controller.serviceAccountName" -}}
{{- default (include "dscache.controller.fullname" .) .Values.controller.serviceAccount.name }}
{{- end }}
{{- define "dscache.webhook.serviceAccountName" -}}
{{- default (include "dscache.webhook.fullname" .) .Values.webhook.serviceAccount.name }}
{{- end }}
{{- define "dscache.node.serviceAccountName" -}}
{{- default (include "dscache.node.fullname" .) .Values.nodeAgent.serviceAccount.name }}
{{- end }}

{{/*
cacheRoot, normalised as the operator does (trailing "/" removed). The schema
already demands an absolute path; this refuses the directories whose
<cacheRoot>/<namespace>/<cache> could name a system directory (a namespace
"lib" and a cache "kubelet" under cacheRoot=/var would wipe /var/lib/kubelet).
*/}}
{{- define "dscache.cacheRoot" -}}
{{- $root := .Values.cacheRoot | trimSuffix "/" }}
{{- $forbidden := list "" "/bin" "/boot" "/dev" "/etc" "/home" "/lib" "/lib32" "/lib64" "/media" "/mnt" "/opt" "/proc" "/root" "/run" "/sbin" "/srv" "/sys" "/tmp" "/usr" "/usr/local" "/var" "/var/lib" "/var/log" "/var/run" "/var/tmp" }}
{{- if has $root $forbidden }}
{{- fail (printf "cacheRoot %q is a system directory: wipes delete <cacheRoot>/<namespace>/<cache>, so use a directory dedicated to dscache, e.g. /mnt/nvme/dscache or /var/lib/dscache" .Values.cacheRoot) }}
{{- end }}
{{- $root }}
{{- end }}

{{/*
Where the controller may `get` Secrets (the source check), as JSON: ["*"] for
cluster-wide (the default in cluster-wide mode), a list of namespaces, or []
(sourceCheck.readSecrets=false). sourceCheck.secretNamespaces, when set,
narrows it to exactly those namespaces.
*/}}
{{- define "dscache.secretNamespaces" -}}
{{- if not .Values.sourceCheck.readSecrets }}[]
{{- else if .Values.sourceCheck.secretNamespaces }}{{ .Values.sourceCheck.secretNamespaces | uniq | toJson }}
{{- else if .Values.watchNamespaces }}{{ .Values.watchNamespaces | uniq | toJson }}
{{- else }}["*"]
{{- end }}
{{- end }}

{{/* Whether roles are bound per watched namespace instead of cluster-wide. */}}
{{- define "dscache.rbacNamespaced" -}}
{{- if and .Values.rbac.scopeToWatchNamespaces .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
Environment of both processes (operator/dscache_operator/settings.py). The
controller and the webhook get the same settings: the webhook injects the
stager with them (the stager asks its node's agent on DSCACHE_AGENT_PORT for
room) and the controller builds pre-stage pods with them and sends wipes to the
agents. What only one of them needs is in its Deployment: its ServiceAccount
for the agents' tokens (controller) and the placement weight (webhook).
*/}}
{{- define "dscache.env" -}}
- name: DSCACHE_CACHE_ROOT
  value: {{ include "dscache.cacheRoot" . | quote }}
- name: DSCACHE_STAGER_IMAGE
  value: {{ include "dscache.stagerImage" . | quote }}
- name: DSCACHE_STAGER_PULL_POLICY
  value: {{ .Values.stager.image.pullPolicy | quote }}
- name: DSCACHE_STAGER_RESOURCES
  value: {{ .Values.stager.resources | toJson | quote }}
{{- if not (kindIs "invalid" .Values.stager.concurrency) }}
- name: DSCACHE_STAGER_CONCURRENCY
  value: {{ .Values.stager.concurrency | int | toString | quote }}
{{- end }}
- name: DSCACHE_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: DSCACHE_WATCH_NAMESPACES
  value: {{ join "," .Values.watchNamespaces | quote }}
- name: DSCACHE_AGENT_PORT
  value: {{ .Values.nodeAgent.port | int | toString | quote }}
- name: DSCACHE_PEERS
  value: {{ .Values.peers.enabled | toString | quote }}
- name: DSCACHE_VOLUME_TYPE
  value: {{ .Values.volume.type | quote }}
- name: DSCACHE_RECONCILE_INTERVAL
  value: {{ .Values.controller.reconcileIntervalSeconds | toString | quote }}
- name: DSCACHE_SOURCE_RETRY_INTERVAL
  value: {{ .Values.sourceCheck.retryIntervalSeconds | toString | quote }}
- name: DSCACHE_STS_ENDPOINT
  value: {{ .Values.podIdentity.stsEndpoint | quote }}
- name: DSCACHE_STS_AUDIENCE
  value: {{ .Values.podIdentity.audience | quote }}
- name: DSCACHE_HEALTH_PORT
  value: {{ .Values.health.port | int | toString | quote }}
- name: DSCACHE_METRICS_PORT
  value: {{ ternary (.Values.metrics.port | int) 0 .Values.metrics.enabled | toString | quote }}
- name: DSCACHE_LOG_LEVEL
  value: {{ .Values.logging.level | quote }}
- name: DSCACHE_LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
{{- end }}

{{/* Pod scheduling and security shared by both Deployments. Usage: include "dscache.podCommon" (list $ .Values.controller) */}}
{{- define "dscache.podCommon" -}}
{{- $root := index . 0 }}
{{- $c := index . 1 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes on kopf's liveness endpoint (/healthz on DSCACHE_HEALTH_PORT). */}}
{{- define "dscache.livenessProbe" -}}
livenessProbe:
  httpGet:
    path: /healthz
    port: health
  initialDelaySeconds: 5
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/*
Who may call an agent (docs/security.md): the controller sends a token of its own
ServiceAccount for the audience dscache-agent/<node> (a TokenRequest per node); the
agents accept wipes from that ServiceAccount only (DSCACHE_CONTROLLER_SERVICE_ACCOUNT).
With nodeAgent.tls.enabled the controller and the webhook get the agents' CA
(DSCACHE_AGENT_CA_FILE; ca.crt only): the controller calls the agents over TLS,
and the webhook hands the CA to each stager.
*/}}
{{- define "dscache.agentCaDir" -}}/etc/dscache/agent-ca{{- end }}
{{- define "dscache.agentCaEnv" -}}
{{- if .Values.nodeAgent.tls.enabled }}
- name: DSCACHE_AGENT_CA_FILE
  value: {{ printf "%s/ca.crt" (include "dscache.agentCaDir" .) | quote }}
{{- end }}
{{- end }}
{{- define "dscache.agentCaMount" -}}
{{- if .Values.nodeAgent.tls.enabled }}
- name: agent-ca
  mountPath: {{ include "dscache.agentCaDir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{- define "dscache.agentCaVolume" -}}
{{- if .Values.nodeAgent.tls.enabled }}
- name: agent-ca
  secret:
    secretName: {{ include "dscache.agentTlsSecret" . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{/*
A byte size value as the agent reads it: a string as is ("500Gi", "80%"), a
number as an integer (Helm reads numbers in values files as floats, which
toString would print as 5.36870912e+11).
*/}}
{{- define "dscache.size" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ . | int64 | toString }}{{ end }}
{{- end }}
