"""The Grafana dashboards of the kv-epp chart, as code: ``charts/generate.py`` writes them to
``charts/kv-epp/dashboards/<name>.json`` (shipped as files and, with ``dashboards.enabled``, as a ConfigMap).

Every query is PromQL over the metrics the picker (``picker/ops/metrics.py``, ``picker/ops/recorder.py``,
``picker/extproc/sampling.py``, ``picker/flow/metrics.py``), the listener (``listener/metrics.py``) and Envoy's
stats listener (``/stats/prometheus``) export; ``tests/integration/test_dashboard_metrics.py`` checks that each
name exists on live processes. Grafana variables: ``$datasource``, ``$namespace`` and ``$__rate_interval``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NS = 'namespace=~"$namespace"'
RATE = "[$__rate_interval]"
HCM = 'envoy_http_conn_manager_prefix="kv_epp"'  # the clients' listener (EnvoyOptions: stat_prefix kv_epp)
POOL = 'envoy_cluster_name="inference_pool"'
PICKERS = 'envoy_cluster_name="kv_epp_picker"'
FALLBACK = 'decision="fallback"'
NOT_ROUTED = 'outcome!="routed"'
PREFILL_DECODE = 'decision_type="prefill-decode"'
TRANSFER = 'coefficient="transfer_ms_per_token"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
Target = tuple[str, str]  # (PromQL, legend)


def sel(metric: str, *matchers: str) -> str:
    """``metric{namespace=~"$namespace", ...}``."""
    return metric + "{" + ", ".join((NS, *matchers)) + "}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({sel(metric, *matchers)}{RATE})"


def share(num: str, den: str) -> str:
    return f"{num} / {den}"


def quantiles(bucket: str, *matchers: str, scale: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Target]:
    return [
        (f"histogram_quantile({q}, sum by (le) ({rate(bucket, *matchers)})){scale}", f"p{round(q * 100)}") for q in qs
    ]


def quantiles_by(bucket: str, by: str, *matchers: str, qs: tuple[float, ...] = (0.5, 0.99)) -> list[Target]:
    """One series per quantile and value of the label ``by``."""
    return [
        (f"histogram_quantile({q}, sum by (le, {by}) ({rate(bucket, *matchers)}))", f"p{round(q * 100)} {{{{{by}}}}}")
        for q in qs
    ]


class Board:
    """Lays panels out on Grafana's 24-column grid: rows, then panels left to right."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append(
            {
                "id": self._id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def panel(
        self,
        title: str,
        description: str,
        targets: list[Target],
        unit: str = "short",
        kind: str = "timeseries",
        width: int = 8,
        stack: bool = False,
        threshold: float | None = None,
    ) -> None:
        """``threshold``: a red line at that value (timeseries) or the value past which a stat turns red."""
        if self.x + width > 24:
            self.x, self.y = 0, self.y + 8
        defaults: dict[str, Any] = {"unit": unit}
        if kind == "timeseries":
            defaults["custom"] = {"fillOpacity": 10, "stacking": {"mode": "normal" if stack else "none"}}
        if threshold is not None:
            steps = [{"color": "green", "value": None}, {"color": "red", "value": threshold}]
            defaults["thresholds"] = {"mode": "absolute", "steps": steps}
            if kind == "timeseries":
                defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
        options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        if kind == "stat":
            options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value"}
        self.panels.append(
            {
                "id": self._id(),
                "type": kind,
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": options,
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        self.x += width

    def dashboard(self, uid: str, title: str, description: str) -> dict[str, Any]:
        return {
            "uid": uid,
            "title": title,
            "description": description,
            "tags": ["kv-epp"],
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": 39,
            "version": 1,
            "time": {"from": "now-1h", "to": "now"},
            "refresh": "30s",
            "timezone": "",
            "templating": {
                "list": [
                    {
                        "name": "datasource",
                        "label": "Data source",
                        "type": "datasource",
                        "query": "prometheus",
                        "current": {},
                        "hide": 0,
                    },
                    {
                        "name": "namespace",
                        "label": "Namespace",
                        "type": "query",
                        "datasource": DATASOURCE,
                        "query": {"query": "label_values(continuum_picker_requests_total, namespace)", "refId": "ns"},
                        "definition": "label_values(continuum_picker_requests_total, namespace)",
                        "refresh": 2,
                        "includeAll": True,
                        "multi": True,
                        "allValue": ".*",
                        "current": {},
                        "hide": 0,
                        "sort": 1,
                    },
                ]
            },
            "annotations": {"list": []},
            "links": [],
            "panels": self.panels,
        }


def routing() -> dict[str, Any]:
    b = Board()
    b.row("Requests and decisions")
    b.panel(
        "Requests by outcome",
        "continuum_picker_requests_total: routed, or answered by the picker itself "
        "(bad_request, no_backend, error, draining, overloaded).",
        [(f"sum by (outcome) ({rate('continuum_picker_requests_total')})", "{{outcome}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Decisions by strategy",
        "continuum_picker_decisions_total by the deciding strategy (KvCost, KvOverlap, "
        "session, the selection strategy).",
        [(f"sum by (strategy) ({rate('continuum_picker_decisions_total')})", "{{strategy}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Tier 4 decisions by decision and tier",
        "continuum_kv_index_routing_decisions_total: kv_aware (sent to a "
        "holder of the prefix, by storage tier) or fallback (nothing held).",
        [(f"sum by (decision, tier) ({rate('continuum_kv_index_routing_decisions_total')})", "{{decision}} {{tier}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Tier 4 fallback share",
        "Share of Tier 4 decisions where no endpoint held the prompt's first block.",
        [
            (
                share(
                    f"sum({rate('continuum_kv_index_routing_decisions_total', FALLBACK)})",
                    f"sum({rate('continuum_kv_index_routing_decisions_total')})",
                ),
                "fallback",
            )
        ],
        "percentunit",
    )
    b.panel(
        "PrefixAwareHash outcomes",
        "continuum_prefix_routing_requests_total (label strategy holds the outcome: prefix_hash, overflow, fallback).",
        [(f"sum by (strategy) ({rate('continuum_prefix_routing_requests_total')})", "{{strategy}}")],
        "reqps",
    )
    b.panel(
        "Requests routed without Tier 4",
        "continuum_kv_tokenize_failures_total: token ids were unavailable (tokenizer timeout, error, ...).",
        [(f"sum by (reason) ({rate('continuum_kv_tokenize_failures_total')})", "{{reason}}")],
        "reqps",
    )

    flow_control(b)
    disaggregation(b)

    b.row("Cached tokens (Tier 4): available, captured, delivered")
    cached = "continuum_picker_cached_tokens_total"

    def tokens(scope: str, kind: str, by: str = "") -> str:
        group = f"sum by ({by}) " if by else "sum"
        matchers = (f'scope="{scope}"', f'kind="{kind}"')
        return f"{group}({rate(cached, *matchers)})"

    b.panel(
        "Shares of the prompt, every tokenized decision",
        "available: the best holder's matched tokens; "
        "captured: the chosen endpoint's; both over the prompt tokens (scope all).",
        [
            (share(tokens("all", "available"), tokens("all", "prompt")), "available"),
            (share(tokens("all", "captured"), tokens("all", "prompt")), "captured"),
        ],
        "percentunit",
    )
    b.panel(
        "Delivered vs predicted, observed responses",
        "Responses whose usage the picker read (sampled or full "
        "response mode): delivered = the engine's cached_tokens.",
        [
            (share(tokens("observed", "delivered"), tokens("observed", "prompt")), "delivered / prompt"),
            (share(tokens("observed", "captured"), tokens("observed", "prompt")), "captured / prompt"),
            (share(tokens("observed", "delivered"), tokens("observed", "captured")), "delivered / captured"),
        ],
        "percentunit",
    )
    b.panel(
        "Estimated delivered share, every decision",
        "captured/prompt over all decisions corrected by the sample's delivered/captured (a ratio estimator).",
        [
            (
                f"({share(tokens('all', 'captured'), tokens('all', 'prompt'))}) * "
                f"({share(tokens('observed', 'delivered'), tokens('observed', 'captured'))})",
                "delivered (est.)",
            )
        ],
        "percentunit",
    )
    b.panel(
        "Captured share by reason",
        "captured / prompt per decision reason (kv_cost, kv_aware, prefix_hash, session, ...).",
        [(share(tokens("all", "captured", "reason"), tokens("all", "prompt", "reason")), "{{reason}}")],
        "percentunit",
    )
    b.panel(
        "Observed predictions by outcome",
        "continuum_picker_observed_predictions_total: hit, stale (the index "
        "named a holder that had lost the prefix), unpredicted, miss.",
        [(f"sum by (outcome) ({rate('continuum_picker_observed_predictions_total')})", "{{outcome}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Responses observed",
        "kv_epp_responses_observed_total by what the picker saw, and the configured sample rate.",
        [
            (f"sum by (observed) ({rate('kv_epp_responses_observed_total')})", "{{observed}}"),
            (f"max({sel('kv_epp_response_sample_rate')})", "sample rate"),
        ],
        "short",
    )
    b.panel(
        "Sampled usage tokens",
        "kv_epp_sampled_usage_tokens_total: prompt and cached tokens of sampled responses that reported usage.",
        [
            (f"sum by (kind) ({rate('kv_epp_sampled_usage_tokens_total')})", "{{kind}}"),
            (f"sum({rate('kv_epp_sampled_usage_responses_total')})", "responses with cached_tokens"),
        ],
        "short",
    )

    b.row("Latency")
    b.panel(
        "Decision CPU",
        "continuum_picker_decision_seconds: parse + keys + pick + commit, per request.",
        quantiles("continuum_picker_decision_seconds_bucket"),
        "s",
    )
    b.panel(
        "Mean decision CPU",
        "Mean of continuum_picker_decision_seconds.",
        [
            (
                share(
                    f"sum({rate('continuum_picker_decision_seconds_sum')})",
                    f"sum({rate('continuum_picker_decision_seconds_count')})",
                ),
                "mean",
            )
        ],
        "s",
    )
    b.panel(
        "Routing latency (ext_proc, the picker's view)",
        'continuum_picker_route_seconds{outcome="routed"}: from the request headers message received to the '
        "routing answer (destination + envoy.lb metadata) sent, per routed request; with a request body it includes "
        "the body's arrival (the pick needs the whole body). Refusals are outcome bad_request, overloaded, "
        "no_backend, error.",
        quantiles("continuum_picker_route_seconds_bucket", 'outcome="routed"', qs=(0.5, 0.99)),
        "s",
    )
    b.panel(
        "Request time through Envoy",
        "envoy_http_downstream_rq_time: the client's whole exchange (request, routing, the engine's answer) as "
        "Envoy times it; compare with the engines' share (upstream time) and the routing latency.",
        quantiles("envoy_http_downstream_rq_time_bucket", 'envoy_http_conn_manager_prefix="kv_epp"'),
        "ms",
    )
    b.panel(
        "Upstream request time",
        "envoy_cluster_upstream_rq_time of the pool (the engines' share).",
        quantiles("envoy_cluster_upstream_rq_time_bucket", 'envoy_cluster_name="inference_pool"'),
        "ms",
    )
    b.panel(
        "ext_proc streams",
        "Envoy's ext_proc filter: streams started, failed, message timeouts and requests "
        "let through without the picker (fail-open).",
        [
            (f"sum({rate('envoy_http_ext_proc_streams_started')})", "started"),
            (f"sum({rate('envoy_http_ext_proc_streams_failed')})", "failed"),
            (f"sum({rate('envoy_http_ext_proc_message_timeouts')})", "message timeouts"),
            (f"sum({rate('envoy_http_ext_proc_failure_mode_allowed')})", "fail-open"),
        ],
        "reqps",
    )
    b.panel(
        "Tier 4 overlap score",
        "continuum_kv_index_overlap_score of kv_aware decisions.",
        quantiles("continuum_kv_index_overlap_score_bucket"),
        "percentunit",
    )
    b.panel(
        "Cost model coefficients",
        "continuum_picker_ttft_model: the fitted TTFT coefficients.",
        [(f"max by (coefficient) ({sel('continuum_picker_ttft_model')})", "{{coefficient}}")],
        "short",
    )

    b.row("Envoy")
    b.panel(
        "Responses by class",
        "envoy_http_downstream_rq_xx of the clients' listener.",
        [
            (
                f"sum by (envoy_response_code_class) ({rate('envoy_http_downstream_rq_xx', HCM)})",
                "{{envoy_response_code_class}}xx",
            )
        ],
        "reqps",
        stack=True,
    )
    b.panel(
        "Retries to the next ranked endpoint",
        "envoy_cluster_upstream_rq_retry of the pool.",
        [(f"sum({rate('envoy_cluster_upstream_rq_retry', POOL)})", "retries")],
        "reqps",
    )
    b.panel(
        "Hosts Envoy sees",
        "Pool hosts from the headless Service's DNS, and the pickers passing Envoy's health check (kv-epp.accepting).",
        [
            (f"sum by (pod) ({sel('envoy_cluster_membership_total', POOL)})", "pool hosts {{pod}}"),
            (f"sum by (pod) ({sel('envoy_cluster_membership_healthy', PICKERS)})", "healthy pickers {{pod}}"),
        ],
        "short",
    )
    return b.dashboard("kv-epp-routing", "kv-epp / Routing", "Routing decisions, cached tokens, latency and Envoy.")


def flow_control(b: Board) -> None:
    """The "Flow control" row (picker/flow/metrics.py; docs/flow-control.md): empty while flow_control is off."""
    b.row("Flow control")
    b.panel(
        "Queued requests",
        "continuum_picker_flow_control_queued_requests: requests waiting in flow control now, over pickers "
        "(0 while the pool has room or flow control is off).",
        [(f"sum({sel('continuum_picker_flow_control_queued_requests')})", "queued")],
        "short",
        kind="stat",
        width=4,
    )
    b.panel(
        "Queue size by priority",
        "llm_d_epp_flow_control_queue_size by priority band (an InferenceObjective's priority; negative: "
        "sheddable), over pickers and fairness ids.",
        [(f"sum by (priority) ({sel('llm_d_epp_flow_control_queue_size')})", "priority {{priority}}")],
        "short",
        width=10,
        stack=True,
    )
    b.panel(
        "Queue bytes by priority",
        "llm_d_epp_flow_control_queue_bytes: request bodies held by queued requests (bounded by "
        "flow_control.max_bytes per picker).",
        [(f"sum by (priority) ({sel('llm_d_epp_flow_control_queue_bytes')})", "priority {{priority}}")],
        "bytes",
        width=10,
        stack=True,
    )
    b.panel(
        "Pool saturation",
        "llm_d_epp_flow_control_pool_saturation per picker: the mean over routable endpoints of each one's "
        "largest signal over its threshold. At 1.0 (the red line) dispatch stops and requests queue; a band "
        "with a lower saturation_limit stops earlier. Missing or old engine readings count as saturated.",
        [(f"max by (pod) ({sel('llm_d_epp_flow_control_pool_saturation')})", "{{pod}}")],
        "short",
        threshold=1.0,
    )
    b.panel(
        "Dispatched and dropped by outcome and priority",
        "llm_d_epp_flow_control_requests_total: dispatched, or dropped rejected-saturated (a bound full), "
        "rejected-ttl-expired (waited past its TTL), rejected-no-endpoints, rejected-context-cancelled, "
        "rejected-shutting-down.",
        [
            (
                f"sum by (outcome, priority) ({rate('llm_d_epp_flow_control_requests_total')})",
                "{{outcome}} priority {{priority}}",
            )
        ],
        "reqps",
        stack=True,
    )
    b.panel(
        "Queue wait of dispatched requests by priority",
        'llm_d_epp_flow_control_request_queue_duration_seconds{outcome="dispatched"}: time in flow control '
        "before dispatch (about 0 for a request dispatched at once), p50 and p99 per priority band.",
        quantiles_by(
            "llm_d_epp_flow_control_request_queue_duration_seconds_bucket", "priority", 'outcome="dispatched"'
        ),
        "s",
    )


def disaggregation(b: Board) -> None:
    """The "P/D disaggregation" row (picker/request/disagg.py; docs/pd.md): empty while disaggregation is off."""
    b.row("P/D disaggregation")
    b.panel(
        "P/D decisions by type and reason",
        "continuum_picker_disagg_decisions_total: prefill-decode (cost: the cost model agreed; threshold: llm-d's "
        "rule alone) or decode-only (below_threshold, cheaper_local: the remote prefill plus the transfer was "
        "predicted too slow, no_prefill_endpoint: none eligible, with fallback decode_only or the 503).",
        [
            (
                f"sum by (decision_type, reason) ({rate('continuum_picker_disagg_decisions_total')})",
                "{{decision_type}} {{reason}}",
            )
        ],
        "reqps",
        stack=True,
    )
    b.panel(
        "Share of requests prefilled remotely",
        'llm_d_epp_disagg_decision_total{decision_type="prefill-decode"} over all P/D decisions, by model.',
        [
            (
                share(
                    f"sum by (model_name) ({rate('llm_d_epp_disagg_decision_total', PREFILL_DECODE)})",
                    f"sum by (model_name) ({rate('llm_d_epp_disagg_decision_total')})",
                ),
                "{{model_name}}",
            )
        ],
        "percentunit",
    )
    b.panel(
        "KV transfer cost (calibrated)",
        'continuum_picker_ttft_model{coefficient="transfer_ms_per_token"} per picker: the transfer cost the P/D '
        "decision adds per uncached token, fitted from streamed P/D requests' first tokens (transfer_samples).",
        [(f"max by (pod) ({sel('continuum_picker_ttft_model', TRANSFER)})", "{{pod}}")],
        "ms",
    )


def shared_load(b: Board) -> None:
    """The "Scale-out: the shared load view" row (picker/pool/shared_load.py; docs/scale-out.md): empty while
    ``shared_load`` is off."""
    b.row("Scale-out: the shared load view")
    b.panel(
        "Pickers on the shared view",
        "continuum_picker_shared_load_up per picker (0: it scores on its own counts and the engines' metrics) and "
        "the live peers each one sees (continuum_picker_shared_load_peers: N pickers see N-1 each).",
        [
            (f"sum({sel('continuum_picker_shared_load_up')})", "up"),
            (f"count({sel('continuum_picker_shared_load_up')})", "pickers"),
            (f"min({sel('continuum_picker_shared_load_peers')})", "peers (least seen)"),
        ],
        "short",
    )
    b.panel(
        "Shared view entries",
        "continuum_picker_shared_load_messages_total by direction and outcome (malformed: skipped), peers aged "
        "out, outages.",
        [
            (
                f"sum by (direction, outcome) ({rate('continuum_picker_shared_load_messages_total')})",
                "{{direction}} {{outcome}}",
            ),
            (f"sum({rate('continuum_picker_shared_load_peers_expired_total')})", "peers aged out"),
            (f"sum({rate('continuum_picker_shared_load_outages_total')})", "outages"),
        ],
        "ops",
    )
    b.panel(
        "Shared view lag",
        "continuum_picker_shared_load_lag_seconds: from a peer's publication to this picker applying it.",
        quantiles("continuum_picker_shared_load_lag_seconds_bucket"),
        "s",
    )


def pool() -> dict[str, Any]:
    b = Board()
    b.row("Per replica load")
    b.panel(
        "In flight per backend",
        "continuum_prefix_routing_backend_distribution: requests in flight, summed over pickers.",
        [(f"sum by (backend) ({sel('continuum_prefix_routing_backend_distribution')})", "{{backend}}")],
        "short",
    )
    b.panel(
        "Engine queue per backend",
        "The engines' own /metrics as the picker scrapes them (max over pickers).",
        [
            (f"max by (backend) ({sel('continuum_engine_requests_waiting')})", "waiting {{backend}}"),
            (f"max by (backend) ({sel('continuum_engine_requests_running')})", "running {{backend}}"),
        ],
        "short",
    )
    b.panel(
        "Engine KV cache usage",
        "continuum_engine_kv_cache_usage (0..1) per backend.",
        [(f"max by (backend) ({sel('continuum_engine_kv_cache_usage')})", "{{backend}}")],
        "percentunit",
    )
    b.panel(
        "Decisions per backend",
        "continuum_picker_decisions_total by backend.",
        [(f"sum by (backend) ({rate('continuum_picker_decisions_total')})", "{{backend}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Responses per backend and status class",
        "continuum_picker_backend_responses_total.",
        [
            (
                f"sum by (backend, status_class) ({rate('continuum_picker_backend_responses_total')})",
                "{{backend}} {{status_class}}",
            )
        ],
        "reqps",
    )
    b.panel(
        "Requests refused by the picker",
        "Admission and availability refusals by outcome.",
        [(f"sum by (outcome) ({rate('continuum_picker_requests_total', NOT_ROUTED)})", "{{outcome}}")],
        "reqps",
        stack=True,
    )

    b.row("Health")
    b.panel(
        "Eligible backends",
        "continuum_picker_backend_healthy (1: eligible), the least over pickers.",
        [(f"min by (backend) ({sel('continuum_picker_backend_healthy')})", "{{backend}}")],
        "short",
    )
    b.panel(
        "Ejections and readmissions",
        "Passive health: ejections by reason, readmissions after the cooldown.",
        [
            (
                f"sum by (backend, reason) ({rate('continuum_picker_backend_ejections_total')})",
                "ejected {{backend}} {{reason}}",
            ),
            (f"sum by (backend) ({rate('continuum_picker_backend_readmissions_total')})", "readmitted {{backend}}"),
        ],
        "ops",
    )
    b.panel(
        "Engine scrapes by outcome",
        "continuum_engine_scrapes_total (ok, timeout, error, too_large, unparsed) and skipped lines.",
        [
            (f"sum by (outcome) ({rate('continuum_engine_scrapes_total')})", "{{outcome}}"),
            (f"sum({rate('continuum_engine_scrape_skipped_lines_total')})", "skipped lines"),
        ],
        "ops",
    )
    b.panel(
        "Engine scrape age",
        "Age of each backend's last good scrape.",
        [(f"max by (backend) ({sel('continuum_engine_scrape_age_seconds')})", "{{backend}}")],
        "s",
    )

    shared_load(b)

    b.row("Discovery and readiness")
    b.panel(
        "Pickers ready",
        "continuum_picker_ready per picker (pool synced and, with Tier 4, feeds caught up).",
        [(f"sum({sel('continuum_picker_ready')})", "ready"), (f"count({sel('continuum_picker_ready')})", "pickers")],
        "short",
    )
    b.panel(
        "Pool synced and size",
        "continuum_picker_pool_synced and continuum_picker_pool_backends per picker.",
        [
            (f"min({sel('continuum_picker_pool_synced')})", "synced (all)"),
            (f"max by (pod) ({sel('continuum_picker_pool_backends')})", "backends {{pod}}"),
        ],
        "short",
    )
    b.panel(
        "Discovery events",
        "The InferencePool watch as the picker and the listener see it (list, watch_event, "
        "bookmark, gone, error, ...).",
        [
            (f"sum by (event) ({rate('continuum_picker_discovery_events_total')})", "picker {{event}}"),
            (f"sum by (event) ({rate('continuum_listener_discovery_events_total')})", "listener {{event}}"),
        ],
        "ops",
    )
    b.panel(
        "Listener sources",
        "continuum_listener_sources: one event source per discovered pod and port.",
        [(f"sum by (pod) ({sel('continuum_listener_sources')})", "{{pod}}")],
        "short",
    )
    b.panel(
        "Background task failures",
        "A crashed task makes its process not ready (it is not restarted).",
        [
            (
                f"sum by (task) (increase({sel('continuum_picker_background_task_failures_total')}[1h]))",
                "picker {{task}}",
            ),
            (f"sum by (task) (increase({sel('kv_listener_background_task_failures_total')}[1h]))", "listener {{task}}"),
        ],
        "short",
    )
    b.panel(
        "Config reloads",
        "continuum_picker_config_reloads_total by result.",
        [(f"sum by (result) (increase({sel('continuum_picker_config_reloads_total')}[1h]))", "{{result}}")],
        "short",
    )
    return b.dashboard(
        "kv-epp-pool", "kv-epp / Pool and replicas", "Per-replica load and health, discovery, readiness."
    )


def kv_index() -> dict[str, Any]:
    b = Board()
    b.row("Index and feeds")
    b.panel(
        "Index entries",
        "continuum_kv_index_entries: (block, backend) entries per picker.",
        [(f"max by (pod) ({sel('continuum_kv_index_entries')})", "{{pod}}")],
        "short",
    )
    b.panel(
        "Feeds by state",
        "Backends per feed state (connecting, live, stale, disconnected), over pickers.",
        [(f"sum by (state) ({sel('continuum_kv_feed_state')})", "{{state}}")],
        "short",
        stack=True,
    )
    b.panel(
        "Feed consumers connected",
        "continuum_kv_consumer_connected per picker.",
        [(f"sum by (pod) ({sel('continuum_kv_consumer_connected')})", "{{pod}}")],
        "short",
    )
    b.panel(
        "Start-up self-check",
        "continuum_kv_self_check: ok, keys_differ, no_events, probe_failed, pending, skipped (backends x pickers).",
        [(f"sum by (result) ({sel('continuum_kv_self_check')})", "{{result}}")],
        "short",
        stack=True,
    )
    b.panel(
        "Feed records the picker dropped",
        "continuum_kv_event_dropped_total per backend.",
        [(f"sum by (backend) ({rate('continuum_kv_event_dropped_total')})", "{{backend}}")],
        "ops",
    )
    b.panel(
        "Requests for unmatched models",
        "continuum_kv_model_unmatched_total: a model no listener source keys "
        "with (add it to model_aliases or lora_adapters).",
        [(f"sum({rate('continuum_kv_model_unmatched_total')})", "unmatched")],
        "reqps",
    )

    b.row("Feed lag")
    b.panel(
        "Listener backlog",
        "kv_listener_backlog_bytes: engine messages received, not yet applied.",
        [(f"sum by (source) ({sel('kv_listener_backlog_bytes')})", "{{source}}")],
        "bytes",
    )
    b.panel(
        "Events received vs applied",
        "The gap between the two is the listener's lag.",
        [
            (f"sum({rate('kv_listener_events_received_total')})", "received"),
            (f"sum({rate('kv_listener_events_processed_total')})", "applied"),
        ],
        "ops",
    )
    b.panel(
        "Feed records published",
        "kv_listener_feed_records_total per backend.",
        [(f"sum by (backend) ({rate('kv_listener_feed_records_total')})", "{{backend}}")],
        "ops",
    )
    b.panel(
        "Feed subscribers",
        "kv_listener_feed_subscribers per backend, and subscribers closed for falling behind (buffer_overflow).",
        [
            (f"sum by (backend) ({sel('kv_listener_feed_subscribers')})", "{{backend}}"),
            (f"sum({rate('kv_listener_feed_overflows_total')})", "overflows"),
        ],
        "short",
    )

    b.row("Listener events and drops")
    b.panel(
        "Engine messages",
        "kv_listener_messages_received_total per source.",
        [(f"sum by (source) ({rate('kv_listener_messages_received_total')})", "{{source}}")],
        "ops",
    )
    b.panel(
        "Dropped by reason",
        "kv_listener_events_dropped_total (malformed, too_large, publisher_not_allowed, duplicate, backlog_full, ...).",
        [(f"sum by (reason) ({rate('kv_listener_events_dropped_total')})", "{{reason}}")],
        "ops",
        stack=True,
    )
    b.panel(
        "Blocks not keyed or pruned",
        "kv_listener_blocks_total by reason.",
        [(f"sum by (reason) ({rate('kv_listener_blocks_total')})", "{{reason}}")],
        "ops",
        stack=True,
    )
    b.panel(
        "Gaps and replays",
        "Sequence gaps, replays by result, engine restarts.",
        [
            (f"sum({rate('kv_listener_sequence_gaps_total')})", "gaps"),
            (f"sum by (result) ({rate('kv_listener_replays_total')})", "replay {{result}}"),
            (f"sum({rate('kv_listener_engine_restarts_total')})", "engine restarts"),
        ],
        "ops",
    )
    b.panel(
        "Incarnation checks and clears",
        "Verdicts after a reconnection, start or gap; backend state cleared.",
        [
            (f"sum by (verdict) ({rate('kv_listener_incarnation_checks_total')})", "{{verdict}}"),
            (f"sum by (reason) ({rate('kv_listener_backend_clears_total')})", "cleared {{reason}}"),
        ],
        "ops",
    )
    b.panel(
        "Tracked blocks",
        "kv_listener_tracked_blocks and retained tokens per source.",
        [
            (f"sum by (source) ({sel('kv_listener_tracked_blocks')})", "blocks {{source}}"),
            (f"sum by (source) ({sel('kv_listener_retained_tokens')})", "tokens {{source}}"),
        ],
        "short",
    )
    b.panel(
        "State file",
        "kv_listener_state_saves_total by result and the last file's size.",
        [
            (f"sum by (result) ({rate('kv_listener_state_saves_total')})", "{{result}}"),
            (f"max({sel('kv_listener_state_bytes')})", "bytes"),
        ],
        "short",
    )

    b.row("Tokenization (Tier 4)")
    b.panel(
        "Token cache lookups",
        "continuum_kv_token_cache_lookups_total: exact, prefix, miss, prefix_after_failure.",
        [(f"sum by (result) ({rate('continuum_kv_token_cache_lookups_total')})", "{{result}}")],
        "reqps",
        stack=True,
    )
    b.panel(
        "Tokenizer calls",
        "continuum_kv_tokenize_calls_total by path (request, background).",
        [(f"sum by (path) ({rate('continuum_kv_tokenize_calls_total')})", "{{path}}")],
        "reqps",
    )
    b.panel(
        "Cache fills and checks",
        "Background fills by outcome, prefix checks by result.",
        [
            (f"sum by (outcome) ({rate('continuum_kv_token_cache_fills_total')})", "fill {{outcome}}"),
            (f"sum by (result) ({rate('continuum_kv_token_cache_checks_total')})", "check {{result}}"),
        ],
        "ops",
    )
    b.panel(
        "Token cache size",
        "continuum_kv_token_cache_bytes per picker.",
        [(f"max by (pod) ({sel('continuum_kv_token_cache_bytes')})", "{{pod}}")],
        "bytes",
    )
    return b.dashboard(
        "kv-epp-kv-index",
        "kv-epp / KV index and listener",
        "Tier 4: the index, its feeds, the listener's events and drops, tokenization.",
    )


DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "kv-epp-routing": routing,
    "kv-epp-pool": pool,
    "kv-epp-kv-index": kv_index,
}
