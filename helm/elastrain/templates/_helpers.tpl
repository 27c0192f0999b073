{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "elastrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "elastrain.fullname" -}}
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

{{- define "elastrain.etcdName" -}}
{{- printf "%s-etcd" (include "elastrain.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "elastrain.workerServiceAccount" -}}
{{- default (printf "%s-worker" (include "elastrain.fullname" .)) .Values.workers.serviceAccount.name -}}
{{- end -}}

{{- define "elastrain.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "elastrain.fullname" .)) .Values.checkpoints.existingClaim -}}
{{- end -}}

{{- define "elastrain.etcdAuthSecret" -}}
{{- default (printf "%s-etcd-root" (include "elastrain.fullname" .)) .Values.etcd.auth.existingSecret -}}
{{- end -}}

{{- define "elastrain.tokenSecret" -}}
{{- default (printf "%s-api-token" (include "elastrain.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------- */}}

{{- define "elastrain.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "elastrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: elastrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "service"). */}}
{{- define "elastrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastrain.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "elastrain.componentLabels" -}}
{{ include "elastrain.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Images ----------------------------------------------------------------------------------- */}}

{{/* (dict "image" .Values.x.image "ctx" $) -> repository@digest or repository:tag */}}
{{- /* The port worker pods call: the workers' port, or the API's when it is 0. */}}
{{- define "elastrain.workerPort" -}}
{{- .Values.service.workerPort | default .Values.service.port -}}
{{- end }}

{{- define "elastrain.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* etcd ------------------------------------------------------------------------------------- */}}

{{- define "elastrain.etcdInternal" -}}
{{- if not .Values.etcd.external.endpoints -}}true{{- end -}}
{{- end -}}

{{/* Comma-separated client URLs (ELASTRAIN_ETCD). */}}
{{- define "elastrain.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $name := include "elastrain.etcdName" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:2379" $name $i $name) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}
{{- end -}}

{{/* The distinct TCP ports of the external etcd endpoints, as a JSON list. */}}
{{- define "elastrain.externalEtcdPorts" -}}
{{- $ports := list -}}
{{- range .Values.etcd.external.endpoints -}}
{{- $u := urlParse . -}}
{{- $hostport := splitList ":" $u.host -}}
{{- $port := ternary (last $hostport) (ternary "443" "2379" (eq $u.scheme "https")) (gt (len $hostport) 1) -}}
{{- $ports = append $ports (int $port) -}}
{{- end -}}
{{- $ports | uniq | toJson -}}
{{- end -}}

{{/* TLS to an external etcd: "true" when etcd.external.tls.existingSecret is set; fails on
values that cannot work, naming them. */}}
{{- define "elastrain.etcdTLS" -}}
{{- $tls := .Values.etcd.external.tls -}}
{{- if $tls.existingSecret -}}
{{- $https := false -}}
{{- range .Values.etcd.external.endpoints -}}
{{- if hasPrefix "https://" . -}}{{- $https = true -}}{{- end -}}
{{- end -}}
{{- if not $https -}}
{{- fail "etcd.external.tls.existingSecret needs https:// endpoints in etcd.external.endpoints (the etcd that speaks TLS); give them, or unset it" -}}
{{- end -}}
{{- if not (or $tls.ca $tls.clientCert) -}}
{{- fail "etcd.external.tls: neither ca nor clientCert is true, so nothing of the Secret would be used; set one, or unset existingSecret" -}}
{{- end -}}
{{- $taken := list "/tmp" (trimSuffix "/" .Values.checkpoints.mountPath) (trimSuffix "/" .Values.service.dataDir.path) "/etc/elastrain/kube" -}}
{{- if has $tls.mountPath $taken -}}
{{- fail (printf "etcd.external.tls.mountPath %s is where the pods mount something else (%s): give it a directory of its own" $tls.mountPath (join ", " $taken)) -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* Monitoring ------------------------------------------------------------------------------- */}}

{{/* (dict "ctx" $ "setting" .Values.monitoring.x.enabled) -> "true" or "" */}}
{{- define "elastrain.monitoringOn" -}}
{{- if eq (toString .setting) "auto" -}}
{{- if .ctx.Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- else if .setting -}}true{{- end -}}
{{- end -}}

{{/* Security contexts (restricted profile) ---------------------------------------------------- */}}

{{/* (dict "ids" .Values.securityContext) */}}
{{- define "elastrain.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .ids.runAsUser }}
runAsGroup: {{ .ids.runAsGroup }}
fsGroup: {{ .ids.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "elastrain.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
