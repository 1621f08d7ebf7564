{{/* Names and labels shared by every template. */}}

{{/* The chart name, or nameOverride. */}}
{{- define "tidegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of object names: <release>-<chart>, or the release name when it holds the chart name. */}}
{{- define "tidegate.fullname" -}}
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
Labels that pick the operator pod. The component "operator" keeps them apart from engine
pods, which the operator labels app.kubernetes.io/name=tidegate as well.
*/}}
{{- define "tidegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tidegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object of the chart. */}}
{{- define "tidegate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tidegate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tidegate
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "tidegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tidegate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository:tag, or repository@digest when a digest is given. */}}
{{- define "tidegate.image" -}}
{{- $image := .Values.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
The label the operator puts on every object it creates (operator/labels.py, MANAGED_BY):
the monitors select engine Services and pods by it.
*/}}
{{- define "tidegate.engineManagedBy" -}}
tidegate-operator
{{- end }}

{{/*
RBAC rules for one namespace the operator serves: what its kopf handlers and its API client
(operator/kube.py) touch. tests/charts/test_chart.py derives the same list from the
operator's code and compares.
*/}}
{{- define "tidegate.namespacedRules" -}}
# The resource itself: kopf lists and watches it, and patches it (finalizers); the
# handlers read it afresh before each reconcile.
- apiGroups: ["tidegate.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Status: conditions, phase and endpoint from the handlers, kopf's bookkeeping (status.kopf).
- apiGroups: ["tidegate.dev"]
  resources: ["llmdeployments/status"]
  verbs: ["patch"]
# The children: created, server-side applied, deleted when stale, watched to notice drift.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Disaggregated: the NetworkPolicy that opens the prefill pods' KV ports to decode pods only.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.autoscaling.driver hpa: an autoscaling/v2 HorizontalPodAutoscaler per pool.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.autoscaling.driver keda: a KEDA ScaledObject per pool.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.gateway.inferencePool: the Gateway API Inference Extension's InferencePool.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A pool whose replicas span nodes: a LeaderWorkerSet (kubernetes-sigs/lws) in place of its
# Deployment.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The autoscaler (driver operator) lists a pool's pods to scrape their /metrics, and
# annotates them with controller.kubernetes.io/pod-deletion-cost before a scale-down; the
# report of LoRA adapters (status.adapters) lists and scrapes the engine pods too.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch"]
# status.revisions: each Deployment's ReplicaSets, one per pod template, with their pods.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["list"]
# Disaggregated: the Secret <name>-kv-curve with the key pair that encrypts the KV transfer,
# created once. Never read: 409 says it exists, and the operator keeps it as it is.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# kopf posts warnings and errors about a resource, and the autoscaler its Scaled events, as
# core/v1 Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if and (gt (int .Values.replicas) 1) .Values.watchNamespaces }}
# Several operator pods serving named namespaces: kopf watches the KopfPeering of each and
# writes its keep-alive there.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}

{{/* Cluster-scoped RBAC rules: kopf's discovery of CRDs (and of namespaces when it serves named ones), and the ClusterKopfPeering of several pods serving every namespace. */}}
{{- define "tidegate.clusterRules" -}}
# kopf watches CRDs to notice when LLMDeployment is installed, upgraded or removed.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
# Serving named namespaces, kopf watches Namespaces to start and stop serving them as they
# come and go.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- else if gt (int .Values.replicas) 1 }}
# Several operator pods serving every namespace: kopf watches their ClusterKopfPeering and
# writes its keep-alive there.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}

{{/* Where the monitors look for engines: the namespaces the operator serves. */}}
{{- define "tidegate.monitoredNamespaces" -}}
{{- if .Values.watchNamespaces }}
matchNames:
  {{- toYaml .Values.watchNamespaces | nindent 2 }}
{{- else }}
any: true
{{- end }}
{{- end }}

{{/* Series carry the LLMDeployment and the role (unified, prefill, decode, router) they come from. */}}
{{- define "tidegate.engineRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
  targetLabel: llmdeployment
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: role
{{- end }}
