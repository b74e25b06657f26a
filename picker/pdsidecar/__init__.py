"""``kv-epp pd-sidecar``: the routing sidecar of prefill/decode disaggregation, one per decode pod, in front of the
local engine. It reads ``x-prefiller-host-port`` (set by the picker, or by llm-d's), runs the prefill leg on that
endpoint and the decode leg on the local engine, with the KV connector's request fields; every other request goes
to the engine untouched. A bottom layer: it imports only ``picker.shared``. See docs/pd.md, "The routing sidecar".

Modules: ``options`` (the flags, checked into ``SidecarOptions``), ``connectors`` (the pure body rewriting of each
KV connector), ``allowlist`` (the SSRF rule: prefill targets inside the pool), ``metrics``, ``proxy`` (the HTTP
handling) and ``run`` (the lifecycle).
"""
