{{/*
Namespace selectors of the webhook entries (operator/deploy/webhook.yaml). The
modes of one volume.type are disjoint, so a namespace is sent to exactly one path:
- node (volume.type csi): opted in, not asking for emptyDir; a CSI volume is
  allowed at every Pod Security level;
- hostPath (volume.type hostPath): opted in, not asking for emptyDir, not enforcing a Pod Security
  level that forbids hostPath;
- emptyDir: opted in and labelled dscache.io/volume=emptyDir;
- podSecurity: opted in, not labelled emptyDir, enforcing baseline or
  restricted (hostPath is forbidden there, so the per-pod emptyDir is used).
*/}}
{{- define "dscache.nsSelector.optIn" -}}
- key: dscache.io/injection
  operator: In
  values: [enabled]
{{- end }}

{{- define "dscache.nsSelector.node" -}}
matchExpressions:
  {{- include "dscache.nsSelector.optIn" . | nindent 2 }}
  - key: dscache.io/volume
    operator: NotIn
    values: [emptyDir]
{{- end }}
{{- define "dscache.nsSelector.hostPath" -}}
matchExpressions:
  {{- include "dscache.nsSelector.optIn" . | nindent 2 }}
  - key: dscache.io/volume
    operator: NotIn
    values: [emptyDir]
  - key: pod-security.kubernetes.io/enforce
    operator: NotIn
    values: [baseline, restricted]
{{- end }}

{{- define "dscache.nsSelector.emptyDir" -}}
matchExpressions:
  {{- include "dscache.nsSelector.optIn" . | nindent 2 }}
  - key: dscache.io/volume
    operator: In
    values: [emptyDir]
{{- end }}

{{- define "dscache.nsSelector.podSecurity" -}}
matchExpressions:
  {{- include "dscache.nsSelector.optIn" . | nindent 2 }}
  - key: dscache.io/volume
    operator: NotIn
    values: [emptyDir]
  - key: pod-security.kubernetes.io/enforce
    operator: In
    values: [baseline, restricted]
{{- end }}

{{/*
cert-manager mode. Without an issuerRef the chart builds its own small PKI:
a self-signed Issuer signs a long-lived CA Certificate, and a CA Issuer signs
the short-lived serving certificate. The caBundle (ca.crt of the serving
Secret) is then the CA, which does not change when the serving certificate
renews, so renewals never open an x509 window.
Usage: include "dscache.certManager" (dict "root" $ "service" .. "secretName" .. "dnsNames" ..)
*/}}
{{- define "dscache.certManager" -}}
{{- $root := .root }}
{{- $cm := $root.Values.certManager }}
{{- $ns := $root.Release.Namespace }}
{{- $base := include "dscache.fullname" $root }}
{{- $issuerRef := $cm.issuerRef }}
{{- if not $issuerRef }}
{{- $issuerRef = dict "name" (printf "%s-ca" $base) "kind" "Issuer" "group" "cert-manager.io" }}
apiVersion: cert-manager.io/v1
kind: Issuer
metadata:
  name: {{ $base }}-selfsigned
  namespace: {{ $ns }}
  labels:
    {{- include "dscache.componentLabels" (list $root "webhook") | nindent 4 }}
spec:
  selfSigned: {}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ $base }}-webhook-ca
  namespace: {{ $ns }}
  labels:
    {{- include "dscache.componentLabels" (list $root "webhook") | nindent 4 }}
spec:
  isCA: true
  commonName: {{ .service }}-ca
  secretName: {{ $base }}-webhook-ca
  duration: {{ $cm.caDuration }}
  privateKey:
    algorithm: ECDSA
    size: 256
  issuerRef:
    name: {{ $base }}-selfsigned
    kind: Issuer
    group: cert-manager.io
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata:
  name: {{ $base }}-ca
  namespace: {{ $ns }}
  labels:
    {{- include "dscache.componentLabels" (list $root "webhook") | nindent 4 }}
spec:
  ca:
    secretName: {{ $base }}-webhook-ca
---
{{- end }}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ .service }}
  namespace: {{ $ns }}
  labels:
    {{- include "dscache.componentLabels" (list $root "webhook") | nindent 4 }}
spec:
  secretName: {{ .secretName }}
  commonName: {{ printf "%s.%s.svc" .service $ns }}
  dnsNames:
    {{- toYaml .dnsNames | nindent 4 }}
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  usages:
    - server auth
    - digital signature
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  issuerRef:
    {{- toYaml $issuerRef | nindent 4 }}
{{- end }}
