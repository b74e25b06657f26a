"""Precise block keys (Tier 4): 64-bit chained hashes over full blocks of token ids.

The listener computes these keys from the ``token_ids`` of BlockStored events and the picker computes
them from a request's token ids; both call this module, so the two always agree. Engine hash
algorithms and PYTHONHASHSEED do not matter.

key(block i)  = blake2b-64(parent_key as 8 bytes BE ++ block tokens as uint32 LE)
root (plain)  = blake2b-64("kv-epp/root" ++ 0x00 ++ model)
root (scoped) = blake2b-64("kv-epp/root/scoped" ++ 0x00 ++ part(model) ++ part(lora_name) ++ part(cache_salt))
part(s)       = 4-byte BE length of s in UTF-8 ++ s  (an absent or empty value is the empty part)

The LoRA adapter and the cache salt are folded into the ROOT of a chain only: every block inherits them
through its parent key, so the listener needs them only where an engine announces a chain's first block
(vLLM sends the salt only in the first block's ``extra_keys``). Length-prefixed parts make every
(model, lora_name, cache_salt) triple a distinct root, a NUL or any other character included; the plain
root (no LoRA, no salt) is unchanged from the scheme's first version.
Only full blocks get a key: a partial trailing block is never cached by an engine.
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
