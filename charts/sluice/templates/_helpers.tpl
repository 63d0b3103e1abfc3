{{- define "sluice.name" -}}sluice{{- end -}}
{{- define "sluice.fullname" -}}{{ printf "%s-sluice" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- define "sluice.labels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "sluice.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}
{{/* The rules sluice needs inside a watched namespace: exactly the API calls the operator makes. */}}
{{- define "sluice.namespacedRules" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  # the pool's Service: its port's protocol, exportTo annotation and waypoint label (status.mesh); watched, so a
  # steady pass reads it only when it changed
  resources: [services]
  verbs: [get, list, watch]
- apiGroups: [networking.istio.io]
  # client namespaces' Sidecars: whether their egress hosts hide the pool's hosts (status.mesh)
  resources: [sidecars]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [inference.sluice.dev]
  resources: [inferencepools]
  verbs: [list, watch, patch]
- apiGroups: [inference.sluice.dev]
  resources: [inferencepools/status]
  verbs: [patch]
- apiGroups: [networking.istio.io]
  resources: [destinationrules, virtualservices, serviceentries, envoyfilters]
  # get/patch: publish by server-side apply (an apply that creates is also authorized as a create);
  # list/delete: prune what a pass no longer renders; update: give an adopted object back exactly;
  # watch: see someone else's edit of an object sluice wrote at once (and list it when the watch starts)
  verbs: [get, create, list, watch, patch, update, delete]
{{- if .Values.ha.enabled }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
