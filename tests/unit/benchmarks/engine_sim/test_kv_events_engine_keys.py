"""The engine simulator's event encoder puts vLLM 0.33's extra keys and SGLang 0.5.23's fields on the wire
(a real listener fed by a running simulator: tests/integration/test_engine_sim_kv_events_engine_keys.py)."""

from __future__ import annotations

import itertools

import msgpack

from benchmarks.engine_sim.kv_events import BlockStoredEvent, KvEventEncoder

KB = 16


def test_vllm_extra_keys_and_sglang_fields_on_the_wire() -> None:
    ev = BlockStoredEvent((b"\x01" * 32, b"\x02" * 32), None, tuple(range(32)), KB, "ad", "t1")
    (vllm,) = KvEventEncoder("map", "uint64", "vllm").encode_events([ev])
    assert vllm["extra_keys"] == [["ad", "t1"], ["ad"]] and vllm["lora_name"] == "ad" and vllm["lora_id"]
    (salt_only,) = KvEventEncoder("array", "uint64", "vllm").encode_events(
        [BlockStoredEvent(ev.digests, None, ev.token_ids, KB, None, "t1")]
    )
    assert salt_only[8] == [["t1"], None]
    pages = KvEventEncoder("map", "uint64", "sglang", sglang_page_size=1).encode_events([ev])
    assert len(pages) == 32 and all(
        p["cache_salt"] == "t1" and p["lora_name"] == "ad" and p["block_size"] == 1 for p in pages
    )
    assert all(p["parent_block_hash"] == q["block_hashes"][0] for q, p in itertools.pairwise(pages))
    plain = msgpack.unpackb(
        KvEventEncoder("map", "uint64", "vllm").encode_batch(
            [BlockStoredEvent(ev.digests, None, ev.token_ids, KB)], 0.0, 0
        )
    )
    assert "extra_keys" not in plain[1][0]
