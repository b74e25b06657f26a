"""Precise block keys (Tier 4): 64-bit chained hashes over full blocks of token ids; the listener and the picker
both call this module, so the two always agree.
See docs/picker.md, "Block keys".
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

MAX_TOKEN_ID = 0xFFFFFFFF


def _digest64(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def _part(value: str | None) -> bytes:
    raw = (value or "").encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(4, "big") + raw


def root_key(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The parent key of a chain's first block: the per-model seed, scoped by LoRA adapter and salt."""
    if not lora_name and not cache_salt:
        return _digest64(b"kv-epp/root\x00" + model.encode("utf-8", "surrogatepass"))
    return _digest64(b"kv-epp/root/scoped\x00" + _part(model) + _part(lora_name) + _part(cache_salt))


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of one full block given its parent's key. Raises ValueError on a token id out of range."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:  # negative or > 2**32-1
        raise ValueError(f"token id out of range: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit on this platform")
    return _digest64(parent.to_bytes(8, "big") + packed.tobytes())


def chain_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: int,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids`` chained from ``parent`` (partial tail ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = max(0, min(n_blocks, max_blocks))
    try:
        packed = array("I", token_ids[: n_blocks * block_size]).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token id out of range: {exc}") from None
    return chain_packed_keys(packed, block_size, parent)


def chain_packed_keys(packed: bytes, block_size: int, parent: int) -> list[int]:
    """Like :func:`chain_block_keys` over token ids already packed as uint32 LE (full blocks only)."""
    stride = block_size * 4
    keys: list[int] = []
    key = parent
    for i in range(len(packed) // stride):
        key = _digest64(key.to_bytes(8, "big") + packed[i * stride : (i + 1) * stride])
        keys.append(key)
    return keys


def request_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """A request's block keys from block 0, rooted in the model's seed scoped by LoRA and salt."""
    return chain_block_keys(token_ids, block_size, root_key(model, lora_name, cache_salt), max_blocks)
