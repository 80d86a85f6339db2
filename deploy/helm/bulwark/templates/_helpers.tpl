{{/* The name of every object: "bulwark" unless fullnameOverride says otherwise. */}}
{{- define "bulwark.name" -}}
{{- default "bulwark" .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object; part-of is the one the kustomize base sets too. */}}
{{- define "bulwark.labels" -}}
app.kubernetes.io/part-of: {{ include "bulwark.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* What the DaemonSet, the PodDisruptionBudget and the Service select on. */}}
{{- define "bulwark.selector" -}}
app.kubernetes.io/name: {{ include "bulwark.name" . }}
{{- end -}}

{{/* Where the DaemonSet mounts what bulwark.yaml names. */}}
{{- define "bulwark.pki" -}}/etc/bulwark/pki{{- end -}}

{{/*
bulwark.yaml: .Values.config with what the chart owns set over it (the paths of its mounts,
the admin token's and the access log's included, the listeners, the apiservers, the fleet's
namespace, the rules' mode), so a value can never point Bulwark at a file the DaemonSet does
not mount.
*/}}
{{- define "bulwark.config" -}}
{{- $pki := include "bulwark.pki" . -}}
{{- $sa := "/var/run/secrets/kubernetes.io/serviceaccount" -}}
{{- $cache := .Values.config.cache | default dict -}}
{{- /* The release's namespace holds the front-proxy key: never cached. */ -}}
{{- $excluded := concat ($cache.excludeNamespaces | default list) (list .Release.Namespace) | uniq -}}
{{- $owned := dict
  "listen" (dict
    "address" (printf "%s:%d" .Values.listen.address (int .Values.listen.port))
    "cert" (printf "%s/serving/tls.crt" $pki)
    "key" (printf "%s/serving/tls.key" $pki)
    "clientCA" (printf "%s/client-ca/ca.crt" $pki))
  "admin" (dict
    "address" (printf "%s:%d" .Values.admin.address (int .Values.admin.port))
    "tokenFile" "/etc/bulwark/admin/token"
    "tls" (dict
      "cert" (printf "%s/serving/tls.crt" $pki)
      "key" (printf "%s/serving/tls.key" $pki))
    "metricsAccess" "authorized")
  "upstream" (dict
    "replicas" .Values.apiservers
    "ca" (printf "%s/ca.crt" $sa)
    "frontProxy" (dict
      "cert" (printf "%s/front-proxy/tls.crt" $pki)
      "key" (printf "%s/front-proxy/tls.key" $pki))
    "self" (dict "tokenFile" (printf "%s/token" $sa)))
  "identity" (dict "tokenReview" (dict "memoryFile" "/var/lib/bulwark/review-memory"))
  "rules" (dict "folder" "/etc/bulwark/rules" "mode" .Values.rules.mode)
  "cache" (dict "excludeNamespaces" $excluded)
  "audit" (dict "path" "/var/log/bulwark/audit.jsonl")
  "fleet" (dict
    "namespace" .Release.Namespace
    "leasePrefix" (printf "%s-" (include "bulwark.name" .)))
-}}
{{- /* The access log goes to the logs volume, when the values keep one. */ -}}
{{- if .Values.config.accessLog }}
{{- $_ := set $owned "accessLog" (dict "path" "/var/log/bulwark/access.jsonl") -}}
{{- end }}
{{- with .Values.kubernetesService.apiservers }}
{{- $_ := set $owned.fleet "keyFile" "/etc/bulwark/fleet/key" -}}
{{- $_ := set $owned.fleet "kubernetesService" (dict "apiservers" .) -}}
{{- end }}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.config) $owned) -}}
{{- end -}}
