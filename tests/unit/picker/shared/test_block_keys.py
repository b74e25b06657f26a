"""Block-key scheme: LoRA adapter and cache salt are folded into the chain's root key only."""

from __future__ import annotations

from picker.shared.block_keys import block_key, chain_block_keys, request_block_keys, root_key

TOKENS = list(range(500, 548))  # three blocks of 16


def test_scoped_roots_cannot_collide_across_the_three_fields() -> None:
    assert root_key("m", "a\x00", "") != root_key("m", "a", "\x00")
    assert root_key("m", "ab", "c") != root_key("m", "a", "bc")
    assert root_key("m\x00", "a") != root_key("m", "\x00a")
    assert root_key("m", "a", None) != root_key("m", None, "a")
    assert root_key("m", None, None) == root_key("m") and root_key("m", "x", None) == root_key("m", "x", "")


def test_salt_and_lora_live_in_the_root_only() -> None:
    root = root_key("m", "ad", "tenant-1")
    keys = request_block_keys(TOKENS, 16, "m", lora_name="ad", cache_salt="tenant-1")
    assert keys == chain_block_keys(TOKENS, 16, root)
    # a child block is keyed from its parent alone: nothing per block
    assert keys[1] == block_key(keys[0], TOKENS[16:32])
    assert keys[0] != request_block_keys(TOKENS, 16, "m")[0]
