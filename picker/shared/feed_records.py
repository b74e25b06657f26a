"""The listener→picker feed format: SSE records of index deltas, written by the listener and read by
the picker through this one module.

    id: <int>   event: put             data: {"keys": ["<hex>", ...], "tier": "gpu_hot"|"storage_warm"}
    id: <int>   event: del             data: {"keys": ["<hex>", ...]}
    id: <int>   event: clear           data: {"reason": "restart"|"all_blocks_cleared"|"gap"|...}
                event: snapshot_begin  data: {"last_id": N, "entries": M}
                event: put ...         (snapshot records carry no id)
    id: N       event: snapshot_end    data: {}
                event: close           data: {"reason": "buffer_overflow"|"draining"}   then EOF
    : keepalive

A block key is written as 16 lowercase hex digits; a reader accepts 1 to 16. Every line and every
record's data is bounded by ``MAX_RECORD_BYTES`` on the reading side.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import orjson

from picker.shared.tiers import StorageTier

PUT, DEL, CLEAR, SNAPSHOT_BEGIN, SNAPSHOT_END, CLOSE = "put", "del", "clear", "snapshot_begin", "snapshot_end", "close"
KEEPALIVE = b": keepalive\n\n"
MAX_RECORD_BYTES = 1 << 20  # the seed's MAX_SSE_BUFFER_SIZE: per line and per record
FEED_TIERS = {t.value: t for t in (StorageTier.GPU_HOT, StorageTier.STORAGE_WARM)}
_HEX64 = re.compile(r"[0-9a-f]{1,16}")


def encode_record(event: str, data: dict[str, object], event_id: int | None = None) -> bytes:
    """One SSE record; ``event_id`` None for records that do not advance the resume position."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


def encode_keys(keys: Iterable[int]) -> list[str]:
    return [format(k, "016x") for k in keys]


def decode_keys(raw: object) -> list[int]:
    """The block keys of a put/del record; ValueError on anything but a list of 1-16 hex digits."""
    if not isinstance(raw, list):
        raise ValueError("keys is not a list")
    out = []
    for k in raw:
        if not isinstance(k, str) or not _HEX64.fullmatch(k):
            raise ValueError("a block key is not 1-16 lowercase hex digits")
        out.append(int(k, 16))
    return out


def decode_tier(raw: object) -> StorageTier:
    tier = FEED_TIERS.get(raw) if isinstance(raw, str) else None
    if tier is None:
        raise ValueError(f"unknown tier {raw!r}")
    return tier


class RecordTooLarge(Exception):
    """An SSE line or record exceeded the parser's bound."""


class SseParser:
    """Incremental SSE parser with bounded buffers. ``feed(bytes)`` returns complete records as
    (event, data, id) tuples; ``id`` is None when the record carries none."""

    def __init__(self, max_bytes: int = MAX_RECORD_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()  # bound: max_bytes without a newline
        self._event = ""
        self._data: list[str] = []
        self._data_len = 0  # bound: max_bytes per record
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[tuple[str, str, str | None]]:
        self._buf += chunk
        out: list[tuple[str, str, str | None]] = []
        start = 0
        while True:
            nl = self._buf.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(self._buf[start:nl]).rstrip(b"\r").decode("utf-8", "replace")
            start = nl + 1
            rec = self._line(line)
            if rec is not None:
                out.append(rec)
        del self._buf[:start]
        if len(self._buf) > self.max_bytes:
            raise RecordTooLarge(f"line over {self.max_bytes} bytes")
        return out

    def _line(self, line: str) -> tuple[str, str, str | None] | None:
        if not line:
            if not self._data and not self._event:
                self._id = None
                return None
            rec = (self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._data_len, self._id = "", [], 0, None
            return rec
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data_len += len(value) + 1
            if self._data_len > self.max_bytes:
                raise RecordTooLarge(f"record over {self.max_bytes} bytes")
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None
