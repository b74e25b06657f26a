"""Decoder + block-chain tracker: encodings, multi-block events, removals, tiers, limits (no sockets)."""

from __future__ import annotations

import msgpack
import pytest

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored, DecodeError, normalise_hash
from listener.msgpack_decoder import decode_batch
from picker.shared.block_keys import request_block_keys
from tests.support.recording_sink import RecordingSink

BS = 4
MODEL = "m"


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


def test_hash_normalisation() -> None:
    assert normalise_hash(-1) == (1 << 64) - 1
    assert normalise_hash((1 << 64) - 5) == (1 << 64) - 5
    assert normalise_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7
    with pytest.raises(DecodeError):
        normalise_hash("x")
    # the same block announced by int64 and by bytes hashes resolves to one node
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


@pytest.mark.parametrize(
    "payload",
    [
        b"\x93\x01",  # truncated
        b"\xc1",  # never-used byte
        b"\xdd\x3b\x9a\xca\x00",  # array header claiming a billion elements, no data
        msgpack.packb("just a string"),
        msgpack.packb([1.0, "not a list", 0]),
    ],
)
def test_hostile_batches_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload, "vllm", 1 << 20)


def test_hostile_events_counted_and_skipped() -> None:
    events = [
        ["BlockStored", "nope", None, [1, 2, 3, 4], BS],
        ["BlockStored", [1], None, [1, 2, -3, 4], BS],
        ["BlockStored", [1], None, [1, 2, 3, 4], 1_000_000_000],  # a billion-token block claim
        ["BlockStored", [1], None, list(range(5000)), BS],  # more tokens than allowed
        {"type": 5},
        ["Mystery", 1],
        7,
        ["BlockStored", [1], None, TOKENS[:4], BS],
    ]
    batch = decode_batch(batch_positional(events), "vllm", 4096)
    assert sorted(batch.dropped) == sorted(["malformed"] * 5 + ["too_large"])
    assert batch.ignored == 1
    assert len(batch.events) == 1


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
