"""listener.block_chains (with the decoder in front, no sockets): both encodings give the picker's keys, chains,
removals, page sizes, LoRA and salt, media and tiers, bounds; and what real vLLM publishes when it offloads a
block to CPU and STORAGE (issue 20)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from listener.block_chains import BlockChainTracker, event_blocks, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored, normalise_hash
from listener.msgpack_decoder import decode_batch
from picker.shared.block_keys import request_block_keys
from tests.support.offload_listener import (
    CPU_REMOVAL,
    CPU_STORE,
    GPU_EVICTION,
    GPU_STORE,
    MODEL,
    OFFLOAD_TOKENS,
    STORAGE_REMOVAL,
    STORAGE_STORE,
    Listener,
    offload_keys,
)
from tests.support.recording_sink import RecordingSink

BS = 4


def tracker(engine: str = "vllm", limits: LimitsConfig | None = None, **kw: object):
    src = SourceConfig(backend_name="b1", engine=engine, model=MODEL, block_size=BS, zmq_endpoint="tcp://x:1", **kw)  # type: ignore[arg-type]
    sink = RecordingSink(strict=False)
    counts: dict[str, int] = {}

    def count(reason: str, n: int) -> None:
        counts[reason] = counts.get(reason, 0) + n

    return BlockChainTracker(src, limits or LimitsConfig(), sink, count, key_block_size=BS), sink, counts


def batch_positional(events: list[list[object]]) -> bytes:
    return msgpack.packb([1.0, events, 0])


def batch_map(events: list[dict[str, object]]) -> bytes:
    return msgpack.packb({"ts": 1.0, "events": events, "data_parallel_rank": 0, "future": 1})


TOKENS = list(range(100, 112))  # three blocks of 4


def test_positional_and_map_encodings_give_same_keys() -> None:
    pos = batch_positional([["BlockStored", [1, 2, 3], None, TOKENS, BS, None, "GPU", None, "extra", 9]])
    mp = batch_map(
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, 2, 3],
                "token_ids": TOKENS,
                "block_size": BS,
                "unknown": 1,
            }
        ]
    )
    expected = request_block_keys(TOKENS, BS, MODEL)
    for payload in (pos, mp):
        t, sink, _ = tracker()
        batch = decode_batch(payload, "vllm", 1 << 20)
        assert batch.dropped == []
        for ev in batch.events:
            t.apply(ev)
        assert sink.state == dict.fromkeys(expected, "gpu_hot")
        assert [t.key_of(h) for h in (1, 2, 3)] == expected


def test_parent_links_chain_and_removal() -> None:
    t, sink, _ = tracker()
    t.apply(BlockStored((1,), None, TOKENS[:4], BS))
    t.apply(BlockStored((2, 3), 1, TOKENS[4:], BS))
    expected = request_block_keys(TOKENS, BS, MODEL)
    assert set(sink.state) == set(expected)
    batch = decode_batch(batch_positional([["BlockRemoved", [3, 999], "GPU"]]), "vllm", 1 << 20)
    for ev in batch.events:
        t.apply(ev)
    assert set(sink.state) == set(expected[:2])
    assert t.chain_token_ids(2) == TOKENS[:8]


def test_a_block_announced_by_int64_and_by_bytes_hashes_is_one_node() -> None:
    t, _sink, _ = tracker()
    t.apply(BlockStored((normalise_hash(-2),), None, TOKENS[:4], BS))
    assert t.key_of(normalise_hash((-2).to_bytes(8, "big", signed=True))) is not None


def test_block_size_mismatch_tracked_without_key_and_children_unattributed(caplog) -> None:
    t, sink, counts = tracker()
    t.apply(BlockStored((1,), None, TOKENS[:3], BS))  # 3 tokens with block_size 4
    t.apply(BlockStored((2,), 1, TOKENS[4:8], BS))
    t.apply(BlockStored((5,), None, TOKENS[:5], BS))
    assert sink.state == {}
    assert t.tracked_blocks == 3
    assert counts["block_size_mismatch"] == 2
    assert counts["unattributed_parent"] == 1
    assert sum("block_size_mismatch" in r.message for r in caplog.records) == 1  # warned once


def test_sglang_partial_page() -> None:
    t, sink, counts = tracker(engine="sglang")
    t.apply(BlockStored((1,), None, TOKENS[:4], BS))
    t.apply(BlockStored((2,), 1, TOKENS[4:6], 2))  # partial last page
    assert set(sink.state) == set(request_block_keys(TOKENS[:4], BS, MODEL))
    assert counts == {}  # the partial page is tracked: its tokens wait in the node's tail for a child
    t.apply(BlockStored((3,), 2, TOKENS[6:8], 2))
    assert set(sink.state) == set(request_block_keys(TOKENS[:8], BS, MODEL))


def test_lora_and_salt_fold_into_keys() -> None:
    t, sink, _ = tracker()
    t.apply(BlockStored((1,), None, TOKENS[:4], BS, lora_id=3, lora_name="ad"))
    t.apply(BlockStored((2,), None, TOKENS[:4], BS, cache_salt="s"))
    assert set(sink.state) == {
        request_block_keys(TOKENS[:4], BS, MODEL, lora_name="ad")[0],
        request_block_keys(TOKENS[:4], BS, MODEL, cache_salt="s")[0],
    }


def test_media_tiers_and_eviction_as_offload() -> None:
    t, sink, _ = tracker(treat_eviction_as_offload=True)
    t.apply(BlockStored((1,), None, TOKENS[:4], BS, medium="GPU"))
    (key,) = sink.state
    t.apply(BlockStored((1,), None, TOKENS[:4], BS, medium="CPU"))
    assert sink.state[key] == "gpu_hot"
    t.apply(decode_batch(batch_positional([["BlockRemoved", [1], "GPU"]]), "vllm", 99).events[0])
    assert sink.state[key] == "storage_warm"
    t.apply(decode_batch(batch_positional([["BlockRemoved", [1], "CPU"]]), "vllm", 99).events[0])
    assert sink.state == {}
    t2, sink2, _ = tracker()
    t2.apply(BlockStored((1,), None, TOKENS[:4], BS, medium="CPU_PINNED"))
    assert list(sink2.state.values()) == ["storage_warm"]
    t2.apply(BlockStored((1,), None, TOKENS[:4], BS, medium=None))
    assert list(sink2.state.values()) == ["gpu_hot"]
    t2.apply(decode_batch(batch_positional([["BlockRemoved", [1], None]]), "vllm", 99).events[0])
    assert list(sink2.state.values()) == ["storage_warm"]  # no offload flag: GPU copy gone, CPU stays


def test_all_blocks_cleared() -> None:
    t, sink, _ = tracker()
    t.apply(BlockStored((1,), None, TOKENS[:4], BS))
    for ev in decode_batch(batch_map([{"type": "AllBlocksCleared"}]), "vllm", 99).events:
        t.apply(ev)
    assert sink.state == {} and sink.clears == ["all_blocks_cleared"] and t.tracked_blocks == 0


def test_memory_bounds_hold_under_a_long_stream() -> None:
    limits = LimitsConfig(max_tracked_blocks=500, max_retained_tokens=1000, max_chain_tokens=64)
    t, sink, counts = tracker(limits=limits)
    h = 1
    for chain in range(400):  # 400 chains x 25 blocks = 10,000 blocks, 40,000 tokens
        parent = None
        toks = [chain * 7 + i for i in range(100)]
        for b in range(0, 100, 20):
            hashes = tuple(range(h, h + 5))
            h += 5
            t.apply(BlockStored(hashes, parent, toks[b : b + 20], BS))
            parent = hashes[-1]
            assert t.tracked_blocks <= limits.max_tracked_blocks
            assert t.retained_tokens <= limits.max_retained_tokens
            assert len(sink.state) <= limits.max_tracked_blocks
    assert counts["pruned_blocks"] > 0 and counts["chain_too_long"] > 0
    # nothing was reset as a whole: the newest chain's first blocks are still keyed
    assert sink.clears == []
    assert len(sink.state) > 0


def test_puts_made_by_a_store_carry_its_page_size_and_tier_changes_none() -> None:
    """Issue 20: the picker's self-check judges an engine on its full pages; each put says the page size of the
    store that made it (an 8-token page here holds two key blocks of 4), a tier change or a removal none."""
    t, sink, _ = tracker()
    pages = [TOKENS[:8]]
    t.apply(BlockStored(block_hashes=(1,), parent_hash=None, token_ids=pages[0], block_size=8))
    assert sink.pages == [8] and len(sink.state) == 2
    t.apply(BlockStored(block_hashes=(1,), parent_hash=None, token_ids=[], block_size=0, medium="CPU"))
    t.apply(BlockRemoved(block_hashes=(1,), medium="GPU"))  # the CPU copy stays: a put to storage_warm
    assert sink.pages == [8, 0] and set(sink.state.values()) == {"storage_warm"}


# -- what real vLLM publishes when it offloads a block ------------------------------------------------------------
# A block offloaded by real vLLM to CPU and STORAGE stays in the index while any copy is left (issue 20).
#
# The payloads of ``data/vllm_offload_sequence.hex`` (one per line) were produced by vLLM 0.32's own code (the
# CPU build of ``.venv-engines``): ``BlockPool`` for the GPU events, the offloading connector's
# ``OffloadingEventsTracker`` with self-describing events for the CPU and STORAGE ones, each ``KVEventBatch``
# encoded as its ``ZmqEventPublisher`` does (msgspec msgpack), with ``ts`` fixed. Regenerate them with
# ``.venv-engines/bin/python -m tests.engines.vllm_offload_events > tests/unit/data/vllm_offload_sequence.hex``.
#
# The six batches: GPU store of two 32-token pages (64 tokens); CPU store of that chunk (both page hashes, its
# 64 tokens, ``block_size`` 32, ``kv_cache_spec_kind`` full_attention); STORAGE store (``locality`` LOCAL,
# ``ownership`` kvcr); GPU eviction (one removal per page); STORAGE removal; CPU removal.
#
# ``data/vllm033_offload_sequence.hex``: the same sequence from vLLM 0.33 (the generator's ``--vllm-src`` with
# the vllm-0.33.0 wheel unpacked: its ``vllm/distributed/kv_events.py``, ``vllm/v1/kv_offload/base.py`` and
# ``.../kv_connector/v1/offloading/events.py`` over the installed 0.32). 0.33 publishes the same events: its
# ``BlockStored`` (kv_events.py lines 56-98: still a tagged map struct, ``omit_defaults``) only gains a last
# field, ``lookahead_token_ids`` (None unless lookahead hashing is on, so omitted). With 15 fields plus the tag
# (14 plus the tag in 0.32) a store no longer fits msgspec's fixmap header, so every store's map header is a
# map16 (``de 00 0a`` where 0.32 wrote ``8a``) with the same entries. The removals (``BlockRemoved``, lines
# 123-130) are unchanged to the byte. The listener keeps the keys with both.
FIXTURES = {"vllm-0.32": "vllm_offload_sequence.hex", "vllm-0.33": "vllm033_offload_sequence.hex"}
SEQUENCES = {
    release: [bytes.fromhex(line) for line in (Path(__file__).parents[1] / "data" / name).read_text().split()]
    for release, name in FIXTURES.items()
}


@pytest.mark.parametrize("release", SEQUENCES)
def test_the_fixture_is_what_vllm_publishes_for_an_offloaded_block(release: str) -> None:
    payloads = SEQUENCES[release]
    events = [decode_batch(p, "vllm", 1 << 20).events for p in payloads]
    (gpu,) = events[GPU_STORE]
    hashes = gpu.block_hashes
    assert isinstance(gpu, BlockStored) and len(hashes) == 2 and gpu.block_size == 32 and gpu.medium == "GPU"
    assert gpu.token_ids == OFFLOAD_TOKENS and gpu.parent_hash is None
    for at, medium in ((CPU_STORE, "CPU"), (STORAGE_STORE, "STORAGE")):
        (ev,) = events[at]
        # self-describing: the chunk's page hashes with its tokens, not a placeholder
        assert isinstance(ev, BlockStored) and ev.medium == medium
        assert (ev.block_hashes, ev.token_ids, ev.block_size, ev.secondary_group) == (hashes, OFFLOAD_TOKENS, 32, False)
    assert sorted(h for ev in events[GPU_EVICTION] for h in ev.block_hashes) == sorted(hashes)
    for at, medium in ((STORAGE_REMOVAL, "STORAGE"), (CPU_REMOVAL, "CPU")):
        (ev,) = events[at]
        assert isinstance(ev, BlockRemoved) and ev.medium == medium and ev.block_hashes == hashes
    raw = msgpack.unpackb(payloads[STORAGE_STORE])[1][0]
    assert (raw["locality"], raw["ownership"]) == ("LOCAL", "kvcr")


def _event_bytes(payload: bytes) -> list[bytes]:
    """Each event of a batch as the publisher encoded it (``[ts, events, dp_rank]``, events a msgpack array)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    assert unpacker.read_array_header() == 3
    unpacker.skip()  # ts
    out = []
    for _ in range(unpacker.read_array_header()):
        start = unpacker.tell()
        unpacker.skip()
        out.append(payload[start : unpacker.tell()])
    return out


def test_vllm_033_publishes_the_same_events_with_wider_store_map_headers() -> None:
    """0.33 changes the encoding of the stores (a map16 header), not what any event says."""
    old, new = SEQUENCES["vllm-0.32"], SEQUENCES["vllm-0.33"]
    assert [msgpack.unpackb(p) for p in new] == [msgpack.unpackb(p) for p in old]
    for at, (a, b) in enumerate(zip(old, new, strict=True)):
        for ev32, ev33 in zip(_event_bytes(a), _event_bytes(b), strict=True):
            if at in (GPU_STORE, CPU_STORE, STORAGE_STORE):  # BlockStored: fixmap in 0.32, map16 in 0.33
                assert ev32[0] & 0xF0 == 0x80 and ev33[:3] == b"\xde\x00" + bytes([ev32[0] & 0x0F])
                assert ev33[3:] == ev32[1:]
            else:  # BlockRemoved: the same bytes
                assert ev33 == ev32
        assert decode_batch(b, "vllm", 1 << 20).events == decode_batch(a, "vllm", 1 << 20).events


@pytest.mark.parametrize("release", SEQUENCES)
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "treat_eviction_as_offload"])
@pytest.mark.parametrize("slice_blocks", [1024, 1])
def test_cpu_copy_keeps_the_keys_after_gpu_and_storage_removals(release: str, offload: bool, slice_blocks: int) -> None:
    live = Listener(offload, slice_blocks)
    expected = {
        GPU_STORE: "gpu_hot",
        CPU_STORE: "gpu_hot",
        STORAGE_STORE: "gpu_hot",
        GPU_EVICTION: "storage_warm",
        STORAGE_REMOVAL: "storage_warm",  # the CPU copy still holds the block
    }
    for at, payload in enumerate(SEQUENCES[release]):
        live.apply(payload)
        tier = expected.get(at)
        want = {} if tier is None else dict.fromkeys(offload_keys(), tier)
        assert live.sink.state == want, f"after batch {at}"
        assert live.restarted().sink.state == want, f"restored after batch {at}"
    assert live.tracker.tracked_blocks == 0 and live.tracker.keyed_blocks == 0
    assert live.counts == {}


# -- work units -------------------------------------------------------------------------------------------------
def test_work_units_split_big_events_with_the_effect_of_the_whole() -> None:
    toks = list(range(5000, 5000 + 10 * BS))
    events = [
        BlockStored(tuple(range(1, 11)), None, toks, BS),  # 10 blocks
        BlockStored((99,), None, toks[:3], BS),  # fails the page check: in every part too
        BlockRemoved(tuple(range(6, 11))),
    ]
    whole, _, _ = tracker()
    whole.apply_all(events)
    for n in (1, 3, 4):
        sliced, sink, counts = tracker()
        units = list(work_units(events, n))
        assert all(sum(event_blocks(e) for e in u) <= n for u in units)
        for unit in units:
            sliced.apply_all(unit)
        assert set(sink.state) == set(request_block_keys(toks[: 5 * BS], BS, MODEL))
        assert sliced.tracked_blocks == whole.tracked_blocks == 6 and counts["block_size_mismatch"] == 1
    with pytest.raises(ValueError):
        list(work_units(events, 0))
