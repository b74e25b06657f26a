"""Decoder for vLLM and SGLang ZMQ payloads (msgpack), both encodings.

Batch: ``[ts, events, dp_rank]`` or a map ``{"ts", "events", "data_parallel_rank"}``. Events:
positional arrays with the tag first (vLLM before mid-2026, older SGLang) or maps with the tag under
``"type"`` (newer vLLM and SGLang). Unknown keys and extra trailing elements are ignored; fields left
at their defaults may be missing. Facts from WIRE.md §3-4; no engine code is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from listener.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KvEvent,
    normalise_hash,
)

MAX_EVENTS_PER_BATCH = 65_536  # more events in one batch is treated as hostile
MAX_BLOCK_SIZE = 65_536  # block_size above this is a hostile claim


@dataclass(slots=True)
class DecodedBatch:
    """The events of one payload that decoded, plus fixed-label reasons for the ones that did not."""

    events: list[KvEvent] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ignored: int = 0  # unknown event tags (forward compatibility, not an error)


def _unpack(payload: bytes, max_array_len: int) -> Any:
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=max_array_len,
            max_map_len=4096,
            max_str_len=1 << 20,
            max_bin_len=1 << 20,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        reason = "too_large" if "exceeds max" in str(exc) else "malformed"
        raise DecodeError(reason, f"msgpack: {type(exc).__name__}") from None


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise DecodeError("malformed", f"{name} is not an int")
    return v


def _opt_str(v: Any, name: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    raise DecodeError("malformed", f"{name} is not a string")


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple):
        raise DecodeError("malformed", "block_hashes is not a list")
    return tuple(normalise_hash(h) for h in v)


def _tokens(v: Any, max_event_tokens: int) -> list[int]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise DecodeError("malformed", "token_ids is not a list")
    if len(v) > max_event_tokens:
        raise DecodeError("too_large", f"{len(v)} token ids")
    for t in v:
        if type(t) is not int or t < 0 or t > 0xFFFFFFFF:
            raise DecodeError("malformed", "token id is not a uint32")
    return v


def _stored(f: dict[str, Any], max_event_tokens: int) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    block_size = _opt_int(f.get("block_size"), "block_size")
    if block_size is None or block_size <= 0 or block_size > MAX_BLOCK_SIZE:
        raise DecodeError("malformed", f"block_size {block_size!r}")
    extra = f.get("extra_keys")
    has_extra = isinstance(extra, list | tuple) and any(x is not None and x != [] for x in extra)
    return BlockStored(
        block_hashes=hashes,
        parent_hash=None if parent is None else normalise_hash(parent),
        token_ids=_tokens(f.get("token_ids"), max_event_tokens),
        block_size=block_size,
        medium=_opt_str(f.get("medium"), "medium"),
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        cache_salt=_opt_str(f.get("cache_salt"), "cache_salt"),
        has_extra_keys=has_extra,
    )


# Positional field order per tag (the reliable prefix only; trailing elements are ignored).
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _as_fields(raw: Any, engine: str) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise DecodeError("malformed", "event map without a string 'type'")
        return tag, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _POSITIONAL.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
        # vLLM appended lora_name after medium; SGLang's later positions differ, so skip them there.
        if tag == "BlockStored" and engine == "vllm" and len(raw) > 7:
            fields["lora_name"] = raw[7]
        return tag, fields
    raise DecodeError("malformed", "event is neither a tagged array nor a map")


def decode_event(raw: Any, engine: str, max_event_tokens: int) -> KvEvent | None:
    """One event, or None for an unknown tag. Raises DecodeError when it is unusable."""
    tag, f = _as_fields(raw, engine)
    if tag == "BlockStored":
        return _stored(f, max_event_tokens)
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(f.get("block_hashes")), medium=_opt_str(f.get("medium"), "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes, engine: str, max_event_tokens: int) -> DecodedBatch:
    """Decode one ZMQ payload. Raises DecodeError only when the batch itself is unusable."""
    obj = _unpack(payload, max(max_event_tokens, MAX_EVENTS_PER_BATCH))
    if isinstance(obj, dict):
        events = obj.get("events")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        events = obj[1]
    else:
        raise DecodeError("malformed", "batch is neither [ts, events, ...] nor a map")
    if not isinstance(events, list | tuple):
        raise DecodeError("malformed", "batch events is not a list")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise DecodeError("too_large", f"{len(events)} events in one batch")
    out = DecodedBatch()
    for raw in events:
        try:
            ev = decode_event(raw, engine, max_event_tokens)
        except DecodeError as exc:
            out.dropped.append(exc.reason)
            continue
        if ev is None:
            out.ignored += 1
        else:
            out.events.append(ev)
    return out
