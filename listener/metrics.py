"""Listener counters at ``/metrics``. Labels: source names (configured or discovered) and fixed reason sets only;
a departed source's series are removed. See docs/listener.md#metrics.
"""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics import MetricWrapperBase

MAX_DISCOVERY_EVENTS = 32  # distinct discovery event names counted; others count as "other"
_EVENT_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class ListenerMetrics:
    """Every metric the listener exports, against one registry (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.messages_received = Counter(
            "kv_listener_messages_received",
            "ZMQ messages / HTTP polls with events received",
            ["source"],
            registry=r,
        )
        self.events_received = Counter(
            "kv_listener_events_received", "Engine KV events decoded", ["source"], registry=r
        )
        self.events_processed = Counter(
            "kv_listener_events_processed", "Engine KV events applied to block chains", ["source"], registry=r
        )
        self.events_dropped = Counter(
            "kv_listener_events_dropped",
            "Messages or events skipped, by reason (malformed, too_large, publisher_not_allowed, "
            "duplicate, backlog_full, ...)",
            ["source", "reason"],
            registry=r,
        )
        self.block_notes = Counter(
            "kv_listener_blocks",
            "Blocks tracked without a key or pruned, by reason (unknown_parent, unattributed_parent, "
            "lora_without_name, multimodal, block_size_mismatch, null_block, placeholder_unknown, too_many_copies, "
            "chain_too_long, pruned_blocks, pruned_token_segments, unknown_hash, ...)",
            ["source", "reason"],
            registry=r,
        )
        self.gaps = Counter("kv_listener_sequence_gaps", "Sequence gaps detected", ["source"], registry=r)
        self.replays = Counter(
            "kv_listener_replays",
            "Replay attempts by result (ok, incomplete, failed)",
            ["source", "result"],
            registry=r,
        )
        self.restarts = Counter(
            "kv_listener_engine_restarts", "Engine restarts detected (sequence reset)", ["source"], registry=r
        )
        self.incarnation_checks = Counter(
            "kv_listener_incarnation_checks",
            "Engine incarnation checks after a reconnection, a listener start or a gap, by verdict "
            "(same, restart, unverifiable)",
            ["source", "verdict"],
            registry=r,
        )
        self.backlog_bytes = Gauge(
            "kv_listener_backlog_bytes", "Engine message bytes received, not yet applied", ["source"], registry=r
        )
        self.state_saves = Counter(
            "kv_listener_state_saves", "State file writes by result (ok, failed, overflow)", ["result"], registry=r
        )
        self.state_bytes = Gauge("kv_listener_state_bytes", "Size of the last state file written", registry=r)
        self.clears = Counter(
            "kv_listener_backend_clears", "Backend state dropped, by reason", ["source", "reason"], registry=r
        )
        self.tracked_blocks = Gauge("kv_listener_tracked_blocks", "Engine blocks tracked", ["source"], registry=r)
        self.retained_tokens = Gauge(
            "kv_listener_retained_tokens", "Token ids retained in chain segments", ["source"], registry=r
        )
        self.subscribers = Gauge("kv_listener_feed_subscribers", "Connected feed consumers", ["backend"], registry=r)
        self.feed_overflows = Counter(
            "kv_listener_feed_overflows",
            "Consumers disconnected with buffer_overflow",
            ["backend"],
            registry=r,
        )
        self.feed_records = Counter(
            "kv_listener_feed_records", "Index delta records published", ["backend"], registry=r
        )
        self.discovery_events = Counter(
            "continuum_listener_discovery_events",
            "Discovery events: the source's own (list, watch_event, bookmark, gone, error, ...) and the listener's "
            "(snapshot_applied, source_added, source_removed, bad_annotation, bad_backend, over_max_sources, "
            "source_open_failed)",
            ["event"],
            registry=r,
        )
        self.sources = Gauge("continuum_listener_sources", "Live event sources", registry=r)
        self._event_names: set[str] = set()
        self.background_task_failures = Counter(
            "kv_listener_background_task_failures",
            "Background tasks that crashed, by task name (sources and gauges); the listener is not ready after one",
            ["task"],
            registry=r,
        )

    def discovery_event(self, event: str, n: int = 1) -> None:
        """Count one discovery event; names are checked and capped (MAX_DISCOVERY_EVENTS) to bound the series."""
        if event not in self._event_names:
            if not _EVENT_NAME.fullmatch(event) or len(self._event_names) >= MAX_DISCOVERY_EVENTS:
                event = "other"
            self._event_names.add(event)
        self.discovery_events.labels(event).inc(n)

    def _per_source(self) -> list[tuple[MetricWrapperBase, tuple[str, ...]]]:
        """(metric, its label names) of every metric labelled by source; the first label names the source."""
        src, reason = ("source",), ("source", "reason")
        return [
            (self.messages_received, src), (self.events_received, src), (self.events_processed, src),
            (self.events_dropped, reason), (self.block_notes, reason), (self.gaps, src),
            (self.replays, ("source", "result")), (self.restarts, src),
            (self.incarnation_checks, ("source", "verdict")), (self.backlog_bytes, src), (self.clears, reason),
            (self.tracked_blocks, src), (self.retained_tokens, src), (self.subscribers, ("backend",)),
            (self.feed_overflows, ("backend",)), (self.feed_records, ("backend",)),
        ]  # fmt: skip

    def forget_source(self, name: str) -> int:
        """Remove every series of source ``name`` (it left the pool); returns how many."""
        return self.forget_sources({name})

    def forget_sources(self, names: AbstractSet[str]) -> int:
        """Remove every series of the sources ``names`` (they left the pool) in one pass over each metric's
        series, whatever the number of sources (a deleted pool drops up to ``discovery.max_sources`` at once);
        returns how many."""
        if not names:
            return 0
        removed = 0
        for metric, labels in self._per_source():
            at = list(metric._labelnames).index(labels[0])
            for values in [v for v in list(metric._metrics) if v[at] in names]:
                metric.remove(*values)
                removed += 1
        tasks = {f"source-{n}" for n in names}  # a discovered source's task (listener.app: _guarded)
        for values in [v for v in list(self.background_task_failures._metrics) if v[0] in tasks]:
            self.background_task_failures.remove(*values)
            removed += 1
        return removed
