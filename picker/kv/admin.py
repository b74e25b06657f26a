"""Tier 4 admin JSON, the seed's shapes. The admin routes (``picker.runtime.admin``) return these dicts:
``GET /admin/kv-index/stats`` → ``kv_index_stats(...)``, ``GET /admin/kv-index/backends`` →
``kv_index_backends(...)``, ``POST /admin/kv-index/clear`` → ``kv_index_clear(index)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from picker.config import KvCacheIndexConfig
from picker.kv.feed_consumer import ConsumerStats
from picker.kv.index import InMemoryKvIndex
from picker.ops.recorder import KvDecisionCounters


def kv_index_stats(
    cfg: KvCacheIndexConfig,
    index: InMemoryKvIndex | None,
    consumers: Sequence[ConsumerStats],
    decisions: KvDecisionCounters,
) -> dict[str, object]:
    """The seed's ``GET /admin/kv-index/stats`` body."""
    sc = cfg.scoring
    return {
        "enabled": cfg.enabled,
        "config": {
            "backend": cfg.backend,
            "max_entries": cfg.max_entries,
            "entry_ttl_seconds": cfg.entry_ttl_seconds,
            "event_sources_count": len(cfg.event_sources),
            "scoring": {
                "overlap_weight": sc.overlap_weight,
                "load_weight": sc.load_weight,
                "health_weight": sc.health_weight,
                "min_overlap_threshold": sc.min_overlap_threshold,
            },
        },
        "index": {
            "prefix_count": index.prefix_count if index else 0,
            "entry_count": index.entry_count if index else 0,
            "total_hits": index.total_hits if index else 0,
            "total_evictions": index.total_evictions if index else 0,
        },
        "event_sources": [c.as_dict() for c in consumers],
        "routing_decisions": {
            "kv_aware": decisions.kv_aware,
            "fallback": decisions.fallback,
            "total": decisions.kv_aware + decisions.fallback,
        },
        "query_latency_count": decisions.query_latency_count,
        "overlap_score_count": decisions.overlap_score_count,
    }


def kv_index_backends(
    enabled: bool, index: InMemoryKvIndex | None, consumers: Sequence[ConsumerStats]
) -> dict[str, object]:
    """The seed's ``GET /admin/kv-index/backends`` body."""
    out = []
    entries = index.backend_entries() if index else {}
    for c in consumers:
        _, created, evicted = index.backend_counters(c.backend_name) if index else (0, 0, 0)
        d = c.as_dict()
        out.append(
            {
                "backend_name": c.backend_name,
                "entries": entries.get(c.backend_name, 0),  # blocks this backend holds now (not in the seed)
                # not in the seed: a digest of the (key, tier) pairs it holds, so two pickers on one feed can
                # be compared (equal digests = identical entries for this backend)
                "entries_digest": entries_digest(index, c.backend_name) if index else None,
                "connection": {
                    "connected": c.connected,
                    "reconnect_count": c.reconnect_count,
                    "last_event_at": d["last_event_at"],
                },
                "events": {
                    "received": c.events_received,
                    "dropped": c.events_dropped,
                    "index_created": created,
                    "index_evicted": evicted,
                },
            }
        )
    return {"enabled": enabled, "backends": out}


def entries_digest(index: InMemoryKvIndex, backend: str) -> str:
    """SHA-256 over the backend's (key, tier) pairs in key order (O(n log n): an admin call, not a request)."""
    h = hashlib.sha256()
    for key, tier in sorted(index.backend_keys(backend).items()):
        h.update(key.to_bytes(8, "big") + (b"g" if tier == "gpu_hot" else b"w"))
    return h.hexdigest()[:32]


def kv_index_clear(index: InMemoryKvIndex) -> dict[str, object]:
    """The seed's ``POST /admin/kv-index/clear`` body (clears the whole index)."""
    before = index.entry_count
    prefixes = index.prefix_count
    index.clear()
    return {"success": True, "entries_before_clear": before, "cleared_entries": prefixes}
