"""Typed engine KV events, normalised from every wire format the listener accepts."""

from __future__ import annotations

from dataclasses import dataclass

U64_MASK = (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Full (or, for SGLang, partial) blocks cached by an engine; the parent links only the first."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    has_extra_keys: bool = False  # multimodal/other extras we cannot reproduce from token ids


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks evicted from ``medium`` (None = GPU / no tier information)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


@dataclass(slots=True, frozen=True)
class SourceReset:
    """TensorRT-LLM ``created``: the cache was (re)created, prior state is void."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | SourceReset


class DecodeError(ValueError):
    """A payload or event that cannot be used; ``reason`` is a fixed metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def normalise_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit int (uint64, int64 two's complement, or bytes)."""
    if isinstance(value, bool):
        raise DecodeError("malformed", "hash is a bool")
    if isinstance(value, int):
        if value < -(1 << 63) or value > U64_MASK:
            raise DecodeError("malformed", "hash out of 64-bit range")
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise DecodeError("malformed", "empty hash bytes")
        return int.from_bytes(raw[-8:], "big")
    raise DecodeError("malformed", f"hash of type {type(value).__name__}")
