{{/* The Envoy container (sidecar of the picker, or the standalone Deployment's). */}}
{{- define "kv-epp.envoyContainer" -}}
- name: envoy
  image: {{ include "kv-epp.envoyImage" . }}
  imagePullPolicy: {{ .Values.envoy.image.pullPolicy }}
  args:
    - --config-path
    - /etc/envoy/envoy.json
    - --disable-hot-restart
    - --concurrency
    - {{ .Values.envoy.concurrency | quote }}
    - --log-level
    - {{ .Values.envoy.logLevel }}
  ports:
    - name: http
      containerPort: {{ .Values.envoy.port }}
      protocol: TCP
    - name: envoy-stats
      containerPort: {{ .Values.envoy.statsPort }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /ready
      port: envoy-stats
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet:
      path: /ready
      port: envoy-stats
    initialDelaySeconds: 10
    periodSeconds: 10
    failureThreshold: 6
  lifecycle:
    preStop:
      sleep:
        seconds: {{ .Values.envoy.drainSeconds }}
  resources:
    {{- toYaml .Values.envoy.resources | nindent 4 }}
  securityContext:
    {{- include "kv-epp.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: envoy-config
      mountPath: /etc/envoy
      readOnly: true
    - name: envoy-tmp
      mountPath: /tmp
    {{- if eq (include "kv-epp.pickerTls" .) "verified" }}
    - name: tls-ca  # the Secret's ca.crt only (never its tls.key)
      mountPath: /etc/kv-epp/tls
      readOnly: true
    {{- end }}
{{- end -}}

{{/* The Envoy container's volumes. */}}
{{- define "kv-epp.envoyVolumes" -}}
- name: envoy-config  # a Secret: the bootstrap holds the ext_proc token (extprocAuth.mode token)
  secret:
    secretName: {{ include "kv-epp.fullname" . }}-envoy
    defaultMode: 0440
- name: envoy-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if eq (include "kv-epp.pickerTls" .) "verified" }}
- name: tls-ca
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}
