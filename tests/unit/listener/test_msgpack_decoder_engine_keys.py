"""Decoder: bounded work per message, hashes per event, placeholders, extra_keys and group fields."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from listener.config import LimitsConfig
from listener.events import BlockRemoved, BlockStored, DecodeError
from listener.msgpack_decoder import decode_batch


def payload(*events: Any) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


def st(**kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5] * 4,
            "block_size": 4, **kw}  # fmt: skip


def test_container_and_item_budgets() -> None:
    events = [["BlockRemoved", [i], "GPU"] for i in range(40)]
    decode_batch(payload(*events), "vllm", 1 << 20, LimitsConfig())
    with pytest.raises(DecodeError) as info:
        decode_batch(payload(*events), "vllm", 1 << 20, LimitsConfig(max_message_containers=50))
    assert info.value.reason == "too_large"
    with pytest.raises(DecodeError) as info:
        decode_batch(
            payload(st(token_ids=[5] * 2000, block_size=2000)), "vllm", 1 << 20, LimitsConfig(max_message_items=1024)
        )
    assert info.value.reason == "too_large"


def test_hashes_per_event_capped() -> None:
    limits = LimitsConfig(max_event_hashes=3)
    batch = decode_batch(
        payload(["BlockRemoved", [1, 2, 3, 4], "GPU"], ["BlockRemoved", [1, 2, 3], "GPU"]), "vllm", 99, limits
    )
    assert batch.dropped == ["too_large"] and batch.events == [BlockRemoved((1, 2, 3), "GPU")]


def test_placeholder_groups_and_extras() -> None:
    batch = decode_batch(
        payload(
            st(block_size=0, token_ids=[], medium="CPU"),
            st(block_size=0),  # a zero block size with tokens is not a placeholder
            st(group_idx=5000),
            st(group_idx=2, kv_cache_spec_kind="SlidingWindowSpec", extra_keys=[[b"mm"]]),
            st(kv_cache_spec_kind="FullAttentionSpec", extra_keys=[["ad", "salt"]], lora_id=1, lora_name="ad"),
        ),
        "vllm",
        99,
    )
    assert batch.dropped == ["malformed", "malformed"]
    placeholder, sliding, full = batch.events
    assert isinstance(placeholder, BlockStored) and placeholder.block_size == 0 and placeholder.token_ids == []
    assert isinstance(sliding, BlockStored) and sliding.secondary_group and sliding.group_idx == 2
    assert sliding.first_unkeyable == 0
    assert isinstance(full, BlockStored) and full.secondary_group is False and full.cache_salt == "salt"
    assert full.first_unkeyable is None


def test_salt_spelled_like_the_lora_name_is_kept() -> None:
    """vLLM's extra_keys order: adapter name, multimodal hashes, cache salt. Only the leading adapter name is
    dropped: a salt equal to it stays the salt (the picker keys that request with salt "acme")."""
    ev = st(
        block_hashes=[1, 2], token_ids=[5] * 8, lora_id=1, lora_name="acme", extra_keys=[["acme", "acme"], ["acme"]]
    )
    out = decode_batch(payload(ev), "vllm", 1 << 20).events[0]
    assert isinstance(out, BlockStored) and out.cache_salt == "acme" and out.unkeyable_from is None


@pytest.mark.parametrize(
    ("lora_name", "extras", "salt", "unkeyable"),
    [
        ("acme", ["acme"], None, None),  # LoRA, no salt
        (None, ["tenant"], "tenant", None),  # salt, no LoRA
        ("acme", ["acme", "tenant"], "tenant", None),  # both
        (None, ["mmhash", "tenant"], None, 0),  # multimodal before the salt: unkeyable
        ("acme", ["tenant", "acme"], None, 0),  # the adapter name is not first: not vLLM's order
    ],
)
def test_extra_keys_of_the_first_block(
    lora_name: str | None, extras: list[str], salt: str | None, unkeyable: int | None
) -> None:
    lora = {"lora_id": 1, "lora_name": lora_name} if lora_name else {}
    out = decode_batch(payload(st(extra_keys=[extras], **lora)), "vllm", 1 << 20).events[0]
    assert isinstance(out, BlockStored) and out.cache_salt == salt and out.unkeyable_from == unkeyable
