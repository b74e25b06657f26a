"""Typed engine KV events, normalised from every wire format the listener accepts, and the normalisation of
the wire's values (block hashes, media, a source's health state). See docs/listener.md#events-and-decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass

U64_MASK = (1 << 64) - 1
_GPU_MEDIA = frozenset({"GPU", "gpu", "cuda", "CUDA"})
_KNOWN_MEDIA = frozenset({"CPU", "STORAGE", "CPU_PINNED", "DISK", "EXTERNAL"})
GPU_LABEL = "GPU"
OTHER_LABEL = "OTHER"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Pages cached by an engine; the parent links only the first.

    ``block_size`` is the engine's page size for this event (vLLM block size, SGLang page size, 1 included);
    ``len(token_ids) == len(block_hashes) * block_size``, except SGLang's partial last page. A vLLM CPU
    offloading placeholder has ``block_size == 0`` and no token ids: a new copy of blocks announced before.
    ``cache_salt`` is the salt of the chain this event starts (SGLang's field, or vLLM's first-block
    ``extra_keys``); it matters only when ``parent_hash`` is None (the salt is folded into the chain's root).
    ``unkeyable_from``: index of the first block whose extras (multimodal hashes) cannot be reproduced from
    token ids; that block and every later one are tracked without a key. ``has_extra_keys`` means 0.
    ``group_idx``: vLLM's KV-cache group (hybrid models publish the same hashes per group), None = 0.
    ``secondary_group``: the group is not full attention (sliding window and similar), per
    ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``; None when the event does not say.
    """

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    has_extra_keys: bool = False  # extras on every block that we cannot reproduce (TRT-LLM token extras)
    unkeyable_from: int | None = None
    group_idx: int | None = None
    secondary_group: bool | None = None

    @property
    def first_unkeyable(self) -> int | None:
        """Index of the first block that cannot be keyed from its token ids, or None."""
        return 0 if self.has_extra_keys else self.unkeyable_from


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks evicted from ``medium`` (None = GPU / no tier information) in KV-cache group ``group_idx``."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


@dataclass(slots=True, frozen=True)
class SourceReset:
    """TensorRT-LLM ``created``: the cache was (re)created, prior state is void."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | SourceReset


def source_status(
    live: bool,
    connected: bool,
    ever_connected: bool,
    state_since: float,
    last_event_at: float | None,
    stale_after: float,
) -> dict[str, object]:
    """A source's /healthz state: connecting (never connected), connected, stale (connected, no event for
    ``stale_after`` s), disconnected; with the ages in seconds (monotonic clock)."""
    now = time.monotonic()
    if live:
        ref = max(last_event_at or 0.0, state_since)
        state = "stale" if now - ref > stale_after else "connected"
    else:
        state = "disconnected" if ever_connected else "connecting"
    return {
        "state": state,
        "connected": connected,
        "state_age_seconds": round(now - state_since, 3),
        "last_event_age_seconds": None if last_event_at is None else round(now - last_event_at, 3),
    }


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


def is_gpu_medium(medium: str | None) -> bool:
    """docs/wire.md §3: ``"GPU"`` or null is GpuHot; every other medium is StorageWarm."""
    return medium is None or medium in _GPU_MEDIA


def medium_label(medium: str | None) -> str:
    """The medium a copy is counted under (the tracker's and the state log's name for it)."""
    if is_gpu_medium(medium):
        return GPU_LABEL
    assert medium is not None
    up = medium.upper()
    return up if up in _KNOWN_MEDIA else OTHER_LABEL
