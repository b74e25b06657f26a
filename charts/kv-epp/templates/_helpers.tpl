{{/* Names, labels and the configs the chart computes. */}}

{{- define "kv-epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object name; at most 40 characters so that "<fullname>-picker" etc. stay valid. */}}
{{- define "kv-epp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kv-epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-epp.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of an object: dict "root" $ "component" "picker" */}}
{{- define "kv-epp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kv-epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kv-epp
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kv-epp.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "kv-epp.envoyImage" -}}
{{- $i := .Values.envoy.image -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $i.repository $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository $i.tag -}}
{{- end -}}
{{- end -}}

{{- define "kv-epp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kv-epp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kv-epp.poolName" -}}
{{- required "inferencePool.name is required (the InferencePool the picker follows)" .Values.inferencePool.name -}}
{{- end -}}

{{- define "kv-epp.poolNamespace" -}}
{{- default .Release.Namespace .Values.inferencePool.namespace -}}
{{- end -}}

{{- define "kv-epp.adminSecretName" -}}
{{- default (printf "%s-admin-token" (include "kv-epp.fullname" .)) .Values.admin.token.existingSecret -}}
{{- end -}}

{{/* Where the picker container mounts the admin token Secret (its key as the file "token"). */}}
{{- define "kv-epp.adminTokenDir" -}}
/etc/kv-epp/admin
{{- end -}}

{{- define "kv-epp.extprocTokenSecretName" -}}
{{- printf "%s-extproc-token" (include "kv-epp.fullname" .) -}}
{{- end -}}

{{/* Where the picker container mounts the ext_proc token Secret (its key as the file "token"). */}}
{{- define "kv-epp.extprocTokenDir" -}}
/etc/kv-epp/extproc-auth
{{- end -}}

{{/* The ext_proc bearer token (extprocAuth.mode token), plain text: the live Secret's (helm upgrade keeps it),
else a random one. Made once per render and kept on the root context, so the Secret, Envoy's bootstrap and the
pods' checksums carry the same token. */}}
{{- define "kv-epp.extprocToken" -}}
{{- if not (hasKey . "kvEppExtprocToken") -}}
{{- $name := include "kv-epp.extprocTokenSecretName" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name -}}
{{- $token := randAlphaNum 48 -}}
{{- if and $existing (hasKey (default dict $existing.data) "token") -}}
{{- $token = index $existing.data "token" | b64dec -}}
{{- if not (regexMatch "^[A-Za-z0-9._~+/=-]+$" $token) -}}
{{- fail (printf "the Secret %s (key token) does not hold a bearer token (letters, digits and ._~+/=-): delete it and upgrade to have a new one made" $name) -}}
{{- end -}}
{{- end -}}
{{- $_ := set . "kvEppExtprocToken" $token -}}
{{- end -}}
{{- index . "kvEppExtprocToken" -}}
{{- end -}}

{{/* Pod annotations that roll a pod when what it reads at start changes: checksum/envoy-config (Envoy's bootstrap
without the token) and checksum/extproc-token (the token; the picker and Envoy read it at start). Apart, so that a
render which only made a new token (helm template: no lookup) is told from a changed config. */}}
{{- define "kv-epp.envoyConfigChecksum" -}}
{{- $bootstrap := include "kv-epp.envoyBootstrap" . -}}
{{- if eq .Values.extprocAuth.mode "token" -}}
{{- $bootstrap = replace (include "kv-epp.extprocToken" .) "" $bootstrap -}}
{{- end -}}
{{- $bootstrap | sha256sum -}}
{{- end -}}

{{/* Where the picker container mounts a gemini backend's API-key Secret, one directory per backend holding the
file "api-key" (its api_key_file; charts/generate.py GEMINI_KEY_DIR). */}}
{{- define "kv-epp.geminiKeyDir" -}}
/etc/kv-epp/gemini
{{- end -}}

{{/* The gemini backends as Envoy's external upstreams, JSON {"upstreams": [{"name", "host", "port"}]}: the host
(lower case) and port (443 unless given) of each baseUrl (default: kv-epp.geminiDefaultBaseUrl; the schema allows
https://HOST[:PORT] only), as the picker's GeminiBackendConfig reads them. The generated bootstrap makes a cluster
and a route of each. */}}
{{- define "kv-epp.geminiUpstreams" -}}
{{- $out := list -}}
{{- range .Values.gemini.backends -}}
{{- $url := default (include "kv-epp.geminiDefaultBaseUrl" $) .baseUrl -}}
{{- $host := regexReplaceAll "^https://([^:/]+).*$" $url "${1}" | lower -}}
{{- $port := regexReplaceAll "^https://[^:/]+(:([0-9]+))?/?$" $url "${2}" | default "443" | int -}}
{{- if or (lt $port 1) (gt $port 65535) -}}
{{- fail (printf "gemini.backends %s: baseUrl %s: the port must be 1 to 65535" .name $url) -}}
{{- end -}}
{{- $out = append $out (dict "name" .name "host" $host "port" $port) -}}
{{- end -}}
{{- toJson (dict "upstreams" $out) -}}
{{- end -}}

{{/* "true" when the picker converts the gemini backends' native answers to the OpenAI shape (gemini.backends and
picker.config.gemini_context_cache.prefer_native_api; picker.runtime.envoy_needs.native_conversion): then every
response body must reach the picker. */}}
{{- define "kv-epp.geminiNative" -}}
{{- if and .Values.gemini.backends (dig "gemini_context_cache" "prefer_native_api" false .Values.picker.config) -}}true{{- end -}}
{{- end -}}

{{/* Envoy's response mode: envoy.responseMode, or full when the picker converts gemini answers (as kv-epp
envoy-config derives it; charts/generate.py response_mode). */}}
{{- define "kv-epp.responseMode" -}}
{{- if include "kv-epp.geminiNative" . -}}full{{- else -}}{{ .Values.envoy.responseMode }}{{- end -}}
{{- end -}}

{{/* The picker's pool.backends for gemini.backends: type gemini, the Secret's mounted file as api_key_file. */}}
{{- define "kv-epp.geminiBackends" -}}
{{- $out := list -}}
{{- range .Values.gemini.backends -}}
{{- $b := dict "name" .name "type" "gemini" "base_url" (default (include "kv-epp.geminiDefaultBaseUrl" $) .baseUrl) -}}
{{- $_ := set $b "api_key_file" (printf "%s/%s/api-key" (include "kv-epp.geminiKeyDir" $) .name) -}}
{{- $_ := set $b "models" .models -}}
{{- $out = append $out $b -}}
{{- end -}}
{{- toJson (dict "backends" $out) -}}
{{- end -}}

{{/* How Envoy reaches the picker: off | unverified | verified (charts/generate.py picker_tls). */}}
{{- define "kv-epp.pickerTls" -}}
{{- if eq .Values.tls.mode "plaintext" -}}off
{{- else if and (eq .Values.tls.mode "existingSecret") .Values.tls.verify -}}verified
{{- else -}}unverified
{{- end -}}
{{- end -}}

{{/* Combinations the schema cannot express: refused with a message saying what to change. */}}
{{- define "kv-epp.validate" -}}
{{- $_ := include "kv-epp.poolName" . -}}
{{- if not .Values.inferencePool.selector -}}
{{- fail "inferencePool.selector is required: the matchLabels of the model-server pods (e.g. --set inferencePool.selector.app=vllm)" -}}
{{- end -}}
{{- $flow := dig "flow_control" (dict) .Values.picker.config -}}
{{- if and (dig "enabled" false $flow) (ne .Values.envoy.mode "none") -}}
{{- $wait := max (int64 (dig "default_ttl_ms" 60000 $flow)) (int64 (dig "no_endpoints_ttl_ms" 10000 $flow)) -}}
{{- if le (int64 .Values.envoy.messageTimeoutMs) $wait -}}
{{- fail (printf "picker.config.flow_control: a request may wait %d ms in flow control, so envoy.messageTimeoutMs (%d) must be longer (e.g. %d), or Envoy times the queued request out first" $wait (int64 .Values.envoy.messageTimeoutMs) (add $wait 1000)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.gemini.backends -}}
{{- include "kv-epp.validateGemini" . -}}
{{- end -}}
{{- $poolBackends := dig "pool" "backends" (list) (default (dict) .Values.picker.config) -}}
{{- if $poolBackends -}}
{{- fail "picker.config.pool.backends is refused: the chart's pool is the InferencePool (pool.inference_pool). List Google's Generative Language API under gemini.backends (the chart mounts each API-key Secret and gives Envoy its cluster)" -}}
{{- end -}}
{{- if and (eq .Values.envoy.responseMode "sampled") (ne .Values.envoy.bodyMode "BUFFERED") -}}
{{- fail "envoy.responseMode sampled needs envoy.bodyMode BUFFERED (Envoy ignores a mode override in full-duplex mode)" -}}
{{- end -}}
{{- if and (eq .Values.tls.mode "existingSecret") (not .Values.tls.existingSecret) -}}
{{- fail "tls.mode existingSecret needs tls.existingSecret (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and .Values.tls.verify (ne .Values.tls.mode "existingSecret") -}}
{{- fail "tls.verify needs tls.mode existingSecret (its ca.crt is what Envoy verifies against)" -}}
{{- end -}}
{{- if and .Values.listener.enabled (not .Values.listener.sourceTemplate.model) -}}
{{- fail "listener.enabled needs listener.sourceTemplate.model (the model name the engines serve)" -}}
{{- end -}}
{{- $poolNs := include "kv-epp.poolNamespace" . -}}
{{- if and .Values.inferencePool.create (ne $poolNs .Release.Namespace) -}}
{{- fail (printf "inferencePool.create with inferencePool.namespace %s, not the release's namespace %s: the pool's endpointPickerRef (no namespace field) would name a Service %s-epp in %s, but the pickers and their Service are in %s (a Service selects only pods of its own namespace). Install the release in %s (-n %s), or create the InferencePool yourself and set inferencePool.create=false" $poolNs .Release.Namespace (include "kv-epp.fullname" .) $poolNs .Release.Namespace $poolNs $poolNs) -}}
{{- end -}}
{{- $admin := default (dict) .Values.picker.config.admin -}}
{{- if hasKey $admin "bearer_token" -}}
{{- fail "picker.config.admin.bearer_token is refused: a secret must not be rendered into the picker's ConfigMap. The chart mounts the admin token Secret as admin.bearer_token_file: set admin.token.existingSecret (and admin.token.key) to a Secret holding your token, or leave them empty for a generated one" -}}
{{- end -}}
{{- range .Values.picker.extraEnv -}}
{{- if eq (toString .name) "KV_EPP_ADMIN__BEARER_TOKEN" -}}
{{- fail "picker.extraEnv KV_EPP_ADMIN__BEARER_TOKEN is refused: the chart sets admin.bearer_token_file from the admin token Secret (the picker refuses both); set admin.token.existingSecret and admin.token.key instead" -}}
{{- end -}}
{{- end -}}
{{- $picker := list (list "picker.ports.extproc" .Values.picker.ports.extproc) (list "picker.ports.health" .Values.picker.ports.health) (list "picker.ports.admin" .Values.picker.ports.admin) -}}
{{- $envoy := list (list "envoy.port" .Values.envoy.port) (list "envoy.adminPort" .Values.envoy.adminPort) (list "envoy.statsPort" .Values.envoy.statsPort) -}}
{{- if eq .Values.envoy.mode "sidecar" -}}
{{- include "kv-epp.uniquePorts" (dict "pod" "the picker pod (with its sidecar Envoy)" "ports" (concat $picker $envoy)) -}}
{{- else -}}
{{- include "kv-epp.uniquePorts" (dict "pod" "the picker pod" "ports" $picker) -}}
{{- if eq .Values.envoy.mode "standalone" -}}
{{- include "kv-epp.uniquePorts" (dict "pod" "the Envoy pod" "ports" $envoy) -}}
{{- end -}}
{{- end -}}
{{- $grpcListen := dig "grpc" "listen" "" (default (dict) .Values.listener.config) -}}
{{- if and .Values.listener.enabled $grpcListen -}}
{{- $grpcPort := regexReplaceAll "^.*:" (toString $grpcListen) "" -}}
{{- include "kv-epp.uniquePorts" (dict "pod" "the listener pod" "ports" (list (list "listener.port" .Values.listener.port) (list "listener.config.grpc.listen" $grpcPort))) -}}
{{- end -}}
{{- if and (eq .Values.envoy.mode "sidecar") (gt (int .Values.envoy.drainSeconds) 58) -}}
{{- fail (printf "envoy.drainSeconds %d: at most 58 with the sidecar Envoy (the picker keeps admitting streams for envoy.drainSeconds + 2 s, and its extproc.drain_propagation_seconds is at most 60)" (int .Values.envoy.drainSeconds)) -}}
{{- end -}}
{{- $drain := include "kv-epp.drain" . | fromJson -}}
{{- $needed := addf $drain.propagation $drain.drain 5.0 -}}
{{- if lt (float64 .Values.picker.terminationGracePeriodSeconds) $needed -}}
{{- fail (printf "picker.terminationGracePeriodSeconds %v is too short: the picker's drain takes extproc.drain_propagation_seconds %v (rendered) + extproc.drain_seconds %v, and up to 5 s more to stop its tasks; set it to at least %v" .Values.picker.terminationGracePeriodSeconds $drain.propagation $drain.drain (ceil $needed)) -}}
{{- end -}}
{{- end -}}

{{/* gemini.backends the schema cannot check: the chart's Envoy routes them, names and models are unique, and the
picker's answers conversion is not sampled. */}}
{{- define "kv-epp.validateGemini" -}}
{{- if eq .Values.envoy.mode "none" -}}
{{- fail "gemini.backends needs the chart's Envoy (envoy.mode sidecar or standalone): the picker routes a gemini model's request to Envoy's external cluster for its backend, which a gateway does not have (kv-epp envoy-config --picker-config prints them)" -}}
{{- end -}}
{{- $names := dict -}}
{{- $models := dict -}}
{{- range .Values.gemini.backends -}}
{{- if hasKey $names .name -}}
{{- fail (printf "gemini.backends: the name %s is given twice (each backend has its own Envoy cluster and Secret mount)" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- $backend := .name -}}
{{- range .models -}}
{{- if hasKey $models . -}}
{{- fail (printf "gemini.backends: the model %s is listed by %s and %s (a model goes to one gemini backend)" . (get $models .) $backend) -}}
{{- end -}}
{{- $_ := set $models . $backend -}}
{{- end -}}
{{- end -}}
{{- if and (include "kv-epp.geminiNative" .) (eq .Values.envoy.responseMode "sampled") -}}
{{- fail "envoy.responseMode sampled: picker.config.gemini_context_cache.prefer_native_api is true with gemini.backends, and the picker converts their native answers to the OpenAI shape, so every response body must pass through it: leave envoy.responseMode none (the chart renders full) or set full" -}}
{{- end -}}
{{- $_ := include "kv-epp.geminiUpstreams" . -}}
{{- end -}}

{{/* Fails when two ports of one pod are equal: dict "pod" "<what>" "ports" (list (list "<value path>" port) ...) */}}
{{- define "kv-epp.uniquePorts" -}}
{{- $seen := dict -}}
{{- range .ports -}}
{{- $port := toString (int (index . 1)) -}}
{{- if hasKey $seen $port -}}
{{- fail (printf "%s and %s are both port %s: every port of %s must differ (a second bind fails, or a probe reaches the wrong server)" (get $seen $port) (index . 0) $port $.pod) -}}
{{- end -}}
{{- $_ := set $seen $port (index . 0) -}}
{{- end -}}
{{- end -}}

{{/* The picker's drain, as JSON {"propagation": s, "drain": s}: extproc.drain_propagation_seconds and
drain_seconds from picker.config (absent: the picker's own defaults, 1 and 10). With the sidecar Envoy, the pod's
only client, the propagation is at least envoy.drainSeconds + 2: Envoy accepts requests until its preStop ends, and
every one of them needs the picker to admit its stream (README, "Shutting down without errors"). */}}
{{- define "kv-epp.drain" -}}
{{- $ext := default (dict) .Values.picker.config.extproc -}}
{{- $propagation := 1.0 -}}
{{- $drain := 10.0 -}}
{{- if hasKey $ext "drain_propagation_seconds" -}}
{{- $propagation = float64 (index $ext "drain_propagation_seconds") -}}
{{- end -}}
{{- if hasKey $ext "drain_seconds" -}}
{{- $drain = float64 (index $ext "drain_seconds") -}}
{{- end -}}
{{- if eq .Values.envoy.mode "sidecar" -}}
{{- $propagation = maxf $propagation (add (int .Values.envoy.drainSeconds) 2) -}}
{{- end -}}
{{- toJson (dict "propagation" $propagation "drain" $drain) -}}
{{- end -}}

{{/* host:port, an IPv6 host in brackets: dict "host" "::" "port" 7817 */}}
{{- define "kv-epp.hostPort" -}}
{{- if contains ":" .host -}}
{{- printf "[%s]:%d" .host (int .port) -}}
{{- else -}}
{{- printf "%s:%d" .host (int .port) -}}
{{- end -}}
{{- end -}}

{{- define "kv-epp.listenerUrl" -}}
{{- printf "http://%s-listener.%s.svc.%s:%d" (include "kv-epp.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.listener.port) -}}
{{- end -}}

{{/* The picker's config file: .Values.picker.config under the keys the chart owns. */}}
{{- define "kv-epp.pickerConfig" -}}
{{- $tls := dict "mode" "tls" -}}
{{- if eq .Values.tls.mode "plaintext" -}}
{{- $tls = dict "mode" "plaintext" -}}
{{- else if eq .Values.tls.mode "existingSecret" -}}
{{- $tls = dict "mode" "tls" "cert_file" "/etc/kv-epp/tls/tls.crt" "key_file" "/etc/kv-epp/tls/tls.key" -}}
{{- end -}}
{{- $pool := dict "inference_pool" (dict "name" (include "kv-epp.poolName" .) "namespace" (include "kv-epp.poolNamespace" .)) -}}
{{- if .Values.gemini.backends -}}
{{- $_ := set $pool "backends" (index (include "kv-epp.geminiBackends" . | fromJson) "backends") -}}
{{- end -}}
{{- if ne .Values.envoy.mode "none" -}}
{{- $_ := set $pool "fallbacks" (int .Values.envoy.retries) -}}
{{- end -}}
{{- $drain := include "kv-epp.drain" . | fromJson -}}
{{- $extproc := dict "host" .Values.bindAddress "port" (int .Values.picker.ports.extproc) "health_port" (int .Values.picker.ports.health) "tls" $tls "drain_propagation_seconds" $drain.propagation -}}
{{- if eq .Values.envoy.mode "sidecar" -}}
{{- $_ := set $extproc "accepting_until" "refusing" -}}
{{- else if eq .Values.envoy.mode "standalone" -}}
{{- $_ := set $extproc "accepting_until" "drain" -}}
{{- end -}}
{{- if eq .Values.extprocAuth.mode "token" -}}
{{- $_ := set $extproc "auth" (dict "token_file" (printf "%s/token" (include "kv-epp.extprocTokenDir" .))) -}}
{{- else -}}
{{- $_ := set $extproc "auth" (dict "allow_unauthenticated" true) -}}
{{- end -}}
{{- $forced := dict
  "extproc" $extproc
  "admin" (dict "enabled" true "host" .Values.bindAddress "port" (int .Values.picker.ports.admin) "bearer_token_file" (printf "%s/token" (include "kv-epp.adminTokenDir" .)))
  "pool" $pool
-}}
{{- if .Values.listener.enabled -}}
{{- $template := dict "endpoint" (printf "%s/events/{name}" (include "kv-epp.listenerUrl" .)) -}}
{{- $_ := set $forced "kv_cache_index" (dict "enabled" true "event_source_template" $template) -}}
{{- $_ := set $forced "prefix_routing" (dict "enabled" true) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.picker.config) $forced) -}}
{{- end -}}

{{/* The listener's config file: .Values.listener.config under the keys the chart owns. */}}
{{- define "kv-epp.listenerConfig" -}}
{{- $discovery := dict
  "inference_pool" (dict "name" (include "kv-epp.poolName" .) "namespace" (include "kv-epp.poolNamespace" .))
  "source_template" .Values.listener.sourceTemplate
-}}
{{- $forced := dict "listen" (include "kv-epp.hostPort" (dict "host" .Values.bindAddress "port" .Values.listener.port)) "discovery" $discovery -}}
{{- if .Values.listener.state.enabled -}}
{{- $_ := set $forced "state" (dict "path" "/var/lib/kv-listener/state.bin") -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.listener.config) $forced) -}}
{{- end -}}

{{/* Pod anti-affinity: dict "root" $ "component" "picker" "mode" "soft" */}}
{{- define "kv-epp.antiAffinity" -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "kv-epp.selectorLabels" . | fromYaml)) -}}
{{- if eq .mode "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - {{ toYaml $term | nindent 6 | trim }}
{{- else if eq .mode "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        {{- toYaml $term | nindent 8 }}
{{- end -}}
{{- end -}}

{{/* The restricted security context of every container. */}}
{{- define "kv-epp.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kv-epp.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}
