"""Decoder for vLLM and SGLang ZMQ payloads (msgpack, positional and map encodings) into typed events, with the
decoding work bounded before it can explode (hostile peers). Facts from docs/wire.md §3-4; no engine code is
used. The fields read, the ``extra_keys`` rules and the bounds: docs/listener.md#events-and-decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from listener.config import LimitsConfig
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
MAX_GROUPS = 1024  # group_idx at or above this is a hostile claim (real models have a handful)
_SECONDARY_KINDS = ("sliding", "window", "chunked", "local", "mamba")


@dataclass(slots=True)
class DecodedBatch:
    """The events of one payload that decoded, plus fixed-label reasons for the ones that did not."""

    events: list[KvEvent] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ignored: int = 0  # unknown event tags (forward compatibility, not an error)
    raw_events: list[Any] = field(default_factory=list)  # the undecoded form of ``events`` (the state log)


_DEFAULT_LIMITS = LimitsConfig()


class _Budget(Exception):
    """Raised from a msgpack hook when the payload builds too many containers or elements."""


class _WorkBudget:
    """Counts the containers msgpack builds (``list_hook`` / ``object_hook``); raises past the budget."""

    __slots__ = ("containers", "items")

    def __init__(self, containers: int, items: int) -> None:
        self.containers = containers
        self.items = items

    def on_list(self, value: list[Any]) -> list[Any]:
        self.containers -= 1
        self.items -= len(value)
        if self.containers < 0 or self.items < 0:
            raise _Budget
        return value

    def on_map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self.containers -= 1
        self.items -= 2 * len(value)
        if self.containers < 0 or self.items < 0:
            raise _Budget
        return value


def _unpack(payload: bytes, max_array_len: int, limits: LimitsConfig) -> Any:
    budget = _WorkBudget(limits.max_message_containers, limits.max_message_items)
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
            list_hook=budget.on_list,
            object_hook=budget.on_map,
        )
    except _Budget:
        raise DecodeError("too_large", "decoding budget exceeded") from None
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
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


def _hashes(v: Any, max_hashes: int) -> tuple[int, ...]:
    if not isinstance(v, list | tuple):
        raise DecodeError("malformed", "block_hashes is not a list")
    if len(v) > max_hashes:
        raise DecodeError("too_large", f"{len(v)} block hashes in one event")
    return tuple(normalise_hash(h) for h in v)


def _group(f: dict[str, Any]) -> int | None:
    g = _opt_int(f.get("group_idx"), "group_idx")
    if g is not None and not 0 <= g < MAX_GROUPS:
        raise DecodeError("malformed", f"group_idx {g}")
    return g


def _secondary_group(f: dict[str, Any]) -> bool | None:
    """True for a KV-cache group that is not full attention (sliding window, chunked local, mamba...)."""
    window = f.get("kv_cache_spec_sliding_window")
    if type(window) is int and window > 0:
        return True
    kind = f.get("kv_cache_spec_kind")
    if isinstance(kind, bytes):
        kind = kind.decode("utf-8", "replace")
    if not isinstance(kind, str) or not kind:
        return None
    low = kind.lower()
    return any(w in low for w in _SECONDARY_KINDS)


def _extras(v: Any, n: int, first_is_root: bool, lora_name: str | None) -> tuple[str | None, int | None]:
    """(cache salt from the first block, index of the first block with unreproducible extras)."""
    if v is None:
        return None, None
    if not isinstance(v, list | tuple):
        raise DecodeError("malformed", "extra_keys is not a list")
    salt: str | None = None
    for i, entry in enumerate(v[:n]):
        if entry is None:
            continue
        if not isinstance(entry, list | tuple):
            return salt, i
        rest = list(entry)
        if lora_name and rest and rest[0] == lora_name:
            del rest[0]  # the adapter name leads; a salt spelled like it stays
        if not rest:
            continue
        if i == 0 and first_is_root and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]  # the salt is the last extra of the first block: nothing else may remain
            continue
        return salt, i
    return salt, None


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


def _stored(f: dict[str, Any], max_event_tokens: int, max_hashes: int) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"), max_hashes)
    parent = f.get("parent_block_hash")
    tokens = _tokens(f.get("token_ids"), max_event_tokens)
    block_size = _opt_int(f.get("block_size"), "block_size")
    placeholder = block_size == 0 and not tokens  # vLLM CPU offloading: a new copy of known blocks
    if block_size is None or (block_size <= 0 and not placeholder) or block_size > MAX_BLOCK_SIZE:
        raise DecodeError("malformed", f"block_size {block_size!r}")
    lora_name = _opt_str(f.get("lora_name"), "lora_name")
    salt, unkeyable = _extras(f.get("extra_keys"), len(hashes), parent is None, lora_name)
    return BlockStored(
        block_hashes=hashes,
        parent_hash=None if parent is None else normalise_hash(parent),
        token_ids=tokens,
        block_size=block_size,
        medium=_opt_str(f.get("medium"), "medium"),
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        lora_name=lora_name,
        cache_salt=_opt_str(f.get("cache_salt"), "cache_salt") or salt,
        unkeyable_from=unkeyable,
        group_idx=_group(f),
        secondary_group=_secondary_group(f),
    )


# Positional field order per tag (the reliable prefix only; trailing elements are ignored).
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _looks_like_extra_keys(v: Any, hashes: Any) -> bool:
    if not isinstance(v, list | tuple) or not isinstance(hashes, list | tuple) or len(v) != len(hashes):
        return False
    return any(e is not None for e in v) and all(e is None or isinstance(e, list | tuple) for e in v)


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
            # extra_keys follows in vLLM 0.33; positions past lora_name are not reliable across versions,
            # so it is taken only when it has the shape of extra_keys (one None-or-list entry per hash)
            if len(raw) > 8 and _looks_like_extra_keys(raw[8], raw[1]):
                fields["extra_keys"] = raw[8]
        return tag, fields
    raise DecodeError("malformed", "event is neither a tagged array nor a map")


def decode_event(
    raw: Any, engine: str, max_event_tokens: int, max_event_hashes: int = _DEFAULT_LIMITS.max_event_hashes
) -> KvEvent | None:
    """One event, or None for an unknown tag. Raises DecodeError when it is unusable."""
    tag, f = _as_fields(raw, engine)
    if tag == "BlockStored":
        return _stored(f, max_event_tokens, max_event_hashes)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes"), max_event_hashes),
            medium=_opt_str(f.get("medium"), "medium"),
            group_idx=_group(f),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(
    payload: bytes, engine: str, max_event_tokens: int, limits: LimitsConfig | None = None
) -> DecodedBatch:
    """Decode one ZMQ payload. Raises DecodeError only when the batch itself is unusable.

    ``limits`` supplies the decoding budget and the per-event hash cap (the defaults when None).
    """
    lim = limits or _DEFAULT_LIMITS
    obj = _unpack(payload, max(max_event_tokens, MAX_EVENTS_PER_BATCH), lim)
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
            ev = decode_event(raw, engine, max_event_tokens, lim.max_event_hashes)
        except DecodeError as exc:
            out.dropped.append(exc.reason)
            continue
        if ev is None:
            out.ignored += 1
        else:
            out.events.append(ev)
            out.raw_events.append(raw)  # only what decoded: the state log must not count what was refused
    return out
