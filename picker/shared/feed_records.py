"""The listener→picker feed formats, written by the listener and read by the picker through this one module: SSE
records and the gRPC ``kvfeed.v1.KvFeed`` service's protobuf records (same records, same ids).
See docs/picker.md, "The feed's formats".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import orjson

from picker.shared.kvfeed_pb import feed_pb2 as pb
from picker.shared.tiers import StorageTier

PUT, DEL, CLEAR, SNAPSHOT_BEGIN, SNAPSHOT_END, CLOSE = "put", "del", "clear", "snapshot_begin", "snapshot_end", "close"
HELLO = "hello"
KEEPALIVE = b": keepalive\n\n"
MAX_RECORD_BYTES = 1 << 20  # the seed's MAX_SSE_BUFFER_SIZE: per line and per record
FEED_TIERS = {t.value: t for t in (StorageTier.GPU_HOT, StorageTier.STORAGE_WARM)}
_HEX64 = re.compile(r"[0-9a-f]{1,16}")


def encode_record(event: str, data: dict[str, object], event_id: int | None = None) -> bytes:
    """One SSE record; ``event_id`` None for records that do not advance the resume position."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


def sse_data(kind: str, keys: Sequence[int] | None, text: str, num: int, last: int) -> dict[str, object]:
    """The ``data`` object of one SSE record (docs/picker.md, "The feed's formats")."""
    if kind == PUT:  # num: the engine page size of the store behind it (0: none, the key is left out)
        return {"keys": encode_keys(keys or ()), "tier": text, **({"page": num} if num else {})}
    if kind == DEL:
        return {"keys": encode_keys(keys or ())}
    if kind in (CLEAR, CLOSE):
        return {"reason": text}
    if kind == SNAPSHOT_BEGIN:
        return {"last_id": last, "entries": num}
    return {}


def hello_data(
    backend: str, model: str, engine: str, key_block_size: int, last_id: int, resumed: bool
) -> dict[str, object]:
    return {
        "backend": backend,
        "model": model,
        "engine": engine,
        "key_block_size": key_block_size,
        "last_id": last_id,
        "resumed": resumed,
    }


# -- gRPC (kvfeed.v1) ---------------------------------------------------------------------------------
GRPC_SERVICE = "kvfeed.v1.KvFeed"
GRPC_SUBSCRIBE = f"/{GRPC_SERVICE}/Subscribe"
GRPC_LIST_BACKENDS = f"/{GRPC_SERVICE}/ListBackends"
PB_TIERS = {"gpu_hot": pb.TIER_GPU_HOT, "storage_warm": pb.TIER_STORAGE_WARM}
PB_TIER_NAMES = {v: k for k, v in PB_TIERS.items()}
PB_KEEPALIVE = pb.FeedRecord(keepalive=pb.Keepalive()).SerializeToString()


def pb_record(kind: str, rec_id: int | None, keys: Sequence[int] | None, text: str, num: int, last: int) -> bytes:
    """One serialized ``kvfeed.v1.FeedRecord`` (``rec_id`` None: 0, the record does not advance the resume id)."""
    rec = pb.FeedRecord(id=rec_id or 0)
    if kind == PUT:
        rec.put.keys.extend(keys or ())
        rec.put.tier = PB_TIERS.get(text, pb.TIER_UNSPECIFIED)
        rec.put.page_tokens = num
    elif kind == DEL:
        getattr(rec, "del").keys.extend(keys or ())  # a Python keyword: the field is reached by name
    elif kind == CLEAR:
        rec.clear.reason = text
    elif kind == CLOSE:
        rec.close.reason = text
    elif kind == SNAPSHOT_BEGIN:
        rec.snapshot_begin.last_id = last
        rec.snapshot_begin.entries = num
    elif kind == SNAPSHOT_END:
        rec.snapshot_end.SetInParent()
    else:
        raise ValueError(f"unknown record kind {kind!r}")
    return rec.SerializeToString()


def pb_hello(backend: str, model: str, engine: str, key_block_size: int, last_id: int, resumed: bool) -> bytes:
    hello = pb.Hello(
        backend=backend, model=model, engine=engine, key_block_size=key_block_size, last_id=last_id, resumed=resumed
    )
    return pb.FeedRecord(hello=hello).SerializeToString()


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
