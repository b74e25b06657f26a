"""listener.msgpack_decoder: both batch forms and both event encodings, hostile batches and events (refused or
counted and skipped, never a crash), the decoding budget, ``extra_keys`` (adapter name, salt, multimodal extras),
KV-cache group kinds, and the raw events kept for the state log. More decoder cases, with the engines' own
layouts, are in tests/unit/listener/test_msgpack_decoder_engine_keys.py."""

from __future__ import annotations

import msgpack
import pytest

from listener.config import LimitsConfig
from listener.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError
from listener.msgpack_decoder import decode_batch, decode_event

BS = 4
TOKENS = list(range(100, 112))  # three blocks of 4


def batch_positional(events: list[object]) -> bytes:
    return msgpack.packb([1.0, events, 0])


def test_array_and_map_batches_and_events_decode_alike() -> None:
    positional = ["BlockStored", [1, 2], None, TOKENS[:8], BS, 7, "CPU", "adapter", None, "ignored"]
    as_map = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "token_ids": TOKENS[:8],
        "block_size": BS,
        "lora_id": 7,
        "lora_name": "adapter",
        "medium": "CPU",
        "future": 1,
    }
    a = decode_batch(batch_positional([positional, ["BlockRemoved", [2], "CPU"], ["AllBlocksCleared"]]), "vllm", 99)
    b = decode_batch(
        msgpack.packb({"ts": 1.0, "events": [as_map, {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"},
                                              {"type": "AllBlocksCleared"}], "data_parallel_rank": 0}),
        "vllm",
        99,
    )  # fmt: skip
    assert a.events == b.events
    stored, removed, cleared = a.events
    assert stored == BlockStored((1, 2), None, TOKENS[:8], BS, medium="CPU", lora_id=7, lora_name="adapter")
    assert removed == BlockRemoved((2,), medium="CPU") and cleared == AllBlocksCleared()
    assert a.raw_events == [positional, ["BlockRemoved", [2], "CPU"], ["AllBlocksCleared"]]


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
    assert batch.raw_events == [events[-1]]  # only what decoded reaches the state log


def test_the_decoding_budget_refuses_a_payload_before_it_is_built() -> None:
    limits = LimitsConfig(max_message_containers=16, max_message_items=1024)
    many_containers = batch_positional([["BlockRemoved", [i], "GPU"] for i in range(20)])  # 2 + 40 containers
    with pytest.raises(DecodeError) as exc:
        decode_batch(many_containers, "vllm", 99, limits)
    assert exc.value.reason == "too_large"
    too_many_hashes = batch_positional([["BlockRemoved", list(range(11)), "GPU"]])
    assert decode_batch(too_many_hashes, "vllm", 99, LimitsConfig(max_event_hashes=10)).dropped == ["too_large"]
    assert decode_batch(too_many_hashes, "vllm", 99, LimitsConfig(max_event_hashes=11)).dropped == []


def test_extra_keys_give_the_salt_or_make_blocks_unkeyable() -> None:
    def stored(extra: object, parent: int | None = None, lora: str | None = None) -> BlockStored:
        ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": parent, "token_ids": TOKENS[:8],
              "block_size": BS, "lora_name": lora, "extra_keys": extra}  # fmt: skip
        out = decode_event(ev, "vllm", 99)
        assert isinstance(out, BlockStored)
        return out

    salted = stored([["tenant"], None])
    assert (salted.cache_salt, salted.first_unkeyable) == ("tenant", None)
    assert stored([["ad", "tenant"], ["ad"]], lora="ad").cache_salt == "tenant"  # the adapter name leads
    spelled_like_the_adapter = stored([["ad", "ad"], None], lora="ad")
    assert spelled_like_the_adapter.cache_salt == "ad"  # only the head is the adapter's
    assert stored([None, ["mm-hash"]]).first_unkeyable == 1  # a multimodal extra: that block and the rest
    assert stored([["tenant"], None], parent=9).first_unkeyable == 0  # not a chain's first block: not a salt
    assert stored([["mm", "tenant"], None]).first_unkeyable == 0
    sglang = decode_event({"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "block_size": BS,
                           "cache_salt": "s"}, "sglang", 99)  # fmt: skip
    assert isinstance(sglang, BlockStored) and sglang.cache_salt == "s"


def test_group_kinds_and_placeholders() -> None:
    def group(**kw: object) -> BlockStored:
        out = decode_event({"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "block_size": BS,
                            "group_idx": 1, **kw}, "vllm", 99)  # fmt: skip
        assert isinstance(out, BlockStored)
        return out

    assert group(kv_cache_spec_sliding_window=128).secondary_group is True
    assert group(kv_cache_spec_kind="ChunkedLocalAttention").secondary_group is True
    assert group(kv_cache_spec_kind="full_attention").secondary_group is False
    assert group().secondary_group is None and group().group_idx == 1
    with pytest.raises(DecodeError):
        group(group_idx=1024)
    placeholder = decode_event({"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0,
                                "medium": "CPU"}, "vllm", 99)  # fmt: skip
    assert isinstance(placeholder, BlockStored) and placeholder.block_size == 0
    with pytest.raises(DecodeError):  # block_size 0 with tokens is no placeholder
        decode_event({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}, "vllm", 99)
