"""Precise block keys (Tier 4): 64-bit chained hashes over full blocks of token ids.

The listener computes these keys from the ``token_ids`` of BlockStored events and the picker computes
them from a request's token ids; both call this module, so the two always agree. Engine hash
algorithms and PYTHONHASHSEED do not matter.

key(block i) = blake2b-64(parent_key as 8 bytes BE ++ extra ++ block tokens as uint32 LE)
root parent  = blake2b-64("kv-epp/root" ++ 0x00 ++ model)
extra        = len(lora) ++ lora_name ++ len(salt) ++ cache_salt  (4-byte BE lengths; empty when both absent)
Only full blocks get a key: a partial trailing block is never cached by an engine.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

MAX_TOKEN_ID = 0xFFFFFFFF


def _digest64(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def root_key(model: str) -> int:
    """The parent key of a chain's first block for ``model`` (the per-model seed)."""
    return _digest64(b"kv-epp/root\x00" + model.encode("utf-8"))


def extra_bytes(lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
    """Bytes folded into every block key so LoRA adapters and salted caches never collide. Each part is
    length-prefixed, so no choice of characters (a NUL included) makes two different pairs equal."""
    if not lora_name and not cache_salt:
        return b""
    lora = (lora_name or "").encode("utf-8", "surrogatepass")
    salt = (cache_salt or "").encode("utf-8", "surrogatepass")
    return len(lora).to_bytes(4, "big") + lora + len(salt).to_bytes(4, "big") + salt


def block_key(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """The key of one full block given its parent's key. Raises ValueError on a token id out of range."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:  # negative or > 2**32-1
        raise ValueError(f"token id out of range: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit on this platform")
    data = parent.to_bytes(8, "big") + extra + packed.tobytes()
    return _digest64(data)


def chain_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: int,
    extra: bytes = b"",
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids`` chained from ``parent`` (partial tail ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    try:
        packed = array("I", token_ids[: n_blocks * block_size]).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token id out of range: {exc}") from None
    stride = block_size * 4
    keys: list[int] = []
    key = parent
    for i in range(n_blocks):
        key = _digest64(key.to_bytes(8, "big") + extra + packed[i * stride : (i + 1) * stride])
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
    """A request's block keys from block 0, rooted in the model's seed."""
    return chain_block_keys(token_ids, block_size, root_key(model), extra_bytes(lora_name, cache_salt), max_blocks)
