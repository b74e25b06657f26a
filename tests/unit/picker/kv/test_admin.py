"""Tier 4's admin bodies from a real in-memory index: the stats and backends shapes (zeros without an index),
per-backend counters and digests, and what a clear reports (entries versus block keys)."""

from __future__ import annotations

import hashlib

from picker.config import KvCacheIndexConfig
from picker.kv.admin import entries_digest, kv_index_backends, kv_index_clear, kv_index_stats
from picker.kv.feed_consumer import ConsumerStats
from picker.kv.index import InMemoryKvIndex
from picker.ops.recorder import KvDecisionCounters
from picker.shared.tiers import StorageTier

CFG = KvCacheIndexConfig.model_validate(
    {
        "enabled": True,
        "max_entries": 500,
        "entry_ttl_seconds": 60,
        "event_sources": [
            {"backend_name": "a", "endpoint": "http://10.0.0.1:9000/events"},
            {"backend_name": "b", "endpoint": "http://10.0.0.2:9000/events"},
        ],
    }
)


def index() -> InMemoryKvIndex:
    idx = InMemoryKvIndex(500, 600.0)
    idx.put("a", [1, 2, 3], StorageTier.GPU_HOT)
    idx.put("b", [1], StorageTier.STORAGE_WARM)  # key 1 on both backends
    idx.remove("a", [3])  # left: 3 entries over 2 block keys
    return idx


def test_stats_report_the_config_the_index_and_the_decisions() -> None:
    consumers = [ConsumerStats("a", connected=True, events_received=7, last_event_at=0.0)]
    decisions = KvDecisionCounters(kv_aware=5, fallback=2, query_latency_count=7, overlap_score_count=5)
    body = kv_index_stats(CFG, index(), consumers, decisions)
    assert body["enabled"] is True
    assert body["config"] == {
        "backend": "memory",
        "max_entries": 500,
        "entry_ttl_seconds": 60,
        "event_sources_count": 2,
        "scoring": {"overlap_weight": 0.6, "load_weight": 0.3, "health_weight": 0.1, "min_overlap_threshold": 0.3},
    }
    assert body["index"] == {"prefix_count": 2, "entry_count": 3, "total_hits": 0, "total_evictions": 0}
    assert body["event_sources"] == [consumers[0].as_dict()]
    assert body["routing_decisions"] == {"kv_aware": 5, "fallback": 2, "total": 7}
    assert (body["query_latency_count"], body["overlap_score_count"]) == (7, 5)


def test_stats_without_an_index_are_zeros() -> None:
    body = kv_index_stats(KvCacheIndexConfig(), None, [], KvDecisionCounters())
    assert body["enabled"] is False
    assert body["index"] == {"prefix_count": 0, "entry_count": 0, "total_hits": 0, "total_evictions": 0}
    assert body["event_sources"] == [] and body["routing_decisions"] == {"kv_aware": 0, "fallback": 0, "total": 0}


def test_backends_report_each_consumers_entries_counters_and_digest() -> None:
    idx = index()
    consumers = [
        ConsumerStats("a", connected=True, events_received=9, events_dropped=1, reconnect_count=2, last_event_at=0.0),
        ConsumerStats("ghost"),  # a feed whose backend the index has never seen
    ]
    body = kv_index_backends(True, idx, consumers)
    a, ghost = body["backends"]  # type: ignore[misc]
    assert body["enabled"] is True
    assert a == {
        "backend_name": "a",
        "entries": 2,
        "entries_digest": entries_digest(idx, "a"),
        "connection": {"connected": True, "reconnect_count": 2, "last_event_at": "1970-01-01T00:00:00Z"},
        "events": {"received": 9, "dropped": 1, "index_created": 3, "index_evicted": 1},
    }
    assert ghost["entries"] == 0 and ghost["events"]["index_created"] == 0
    assert ghost["connection"]["last_event_at"] is None


def test_backends_without_an_index_have_no_digest() -> None:
    body = kv_index_backends(False, None, [ConsumerStats("a")])
    [a] = body["backends"]  # type: ignore[misc]
    assert a["entries"] == 0 and a["entries_digest"] is None and a["events"]["index_evicted"] == 0


def test_the_digest_is_over_key_and_tier_in_key_order() -> None:
    idx = InMemoryKvIndex()
    idx.put("a", [2], StorageTier.STORAGE_WARM)
    idx.put("a", [1], StorageTier.GPU_HOT)
    want = hashlib.sha256((1).to_bytes(8, "big") + b"g" + (2).to_bytes(8, "big") + b"w").hexdigest()[:32]
    assert entries_digest(idx, "a") == want
    idx.put("a", [2], StorageTier.GPU_HOT)  # a tier change is a different digest
    assert entries_digest(idx, "a") != want


def test_clear_reports_entries_and_block_keys_and_empties_the_index() -> None:
    idx = index()
    assert kv_index_clear(idx) == {"success": True, "entries_before_clear": 3, "cleared_entries": 2}
    assert (idx.entry_count, idx.prefix_count, idx.backend_entries()) == (0, 0, {"a": 0, "b": 0})
    assert kv_index_clear(idx) == {"success": True, "entries_before_clear": 0, "cleared_entries": 0}
