"""TensorRT-LLM event source: polls ``POST {http_endpoint}/kv_cache_events`` (trtllm-serve) and applies the
events in id order; ``decode_trtllm_event`` turns its JSON events into the tracker's events. See
docs/listener.md#the-tensorrt-llm-source.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.events import (
    BlockRemoved,
    BlockStored,
    DecodeError,
    KvEvent,
    SourceReset,
    normalise_hash,
    source_status,
)
from listener.metrics import ListenerMetrics
from listener.state_store import PersistedSource

log = logging.getLogger("kv_listener.trtllm")


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise DecodeError("malformed", f"{name} is not an int")
    return v


def decode_trtllm_event(data: Any, max_event_tokens: int) -> list[KvEvent] | None:
    """The tracker events of one ``data`` object, or None when the type is ignored."""
    if not isinstance(data, dict):
        raise DecodeError("malformed", "data is not an object")
    kind = data.get("type")
    if kind == "created":
        return [SourceReset()]
    if kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list):
            raise DecodeError("malformed", "block_hashes is not a list")
        return [BlockRemoved(block_hashes=tuple(normalise_hash(h) for h in hashes), medium=None)]
    if kind == "stored":
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise DecodeError("malformed", "blocks is not a list")
        parent_raw = data.get("parent_hash")
        parent = None if parent_raw is None else normalise_hash(parent_raw)
        out: list[KvEvent] = []
        total = 0
        for b in blocks:
            if not isinstance(b, dict) or not isinstance(b.get("tokens"), list):
                raise DecodeError("malformed", "block without a tokens list")
            h = normalise_hash(b.get("block_hash"))
            toks = b["tokens"]
            total += len(toks)
            if total > max_event_tokens:
                raise DecodeError("too_large", f"more than {max_event_tokens} tokens")
            ids: list[int] = []
            extra = False
            for t in toks:
                if not isinstance(t, dict):
                    raise DecodeError("malformed", "token is not an object")
                tid = _int(t.get("token_id"), "token_id")
                if tid < 0 or tid > 0xFFFFFFFF:
                    raise DecodeError("malformed", "token id out of range")
                ids.append(tid)
                extra = extra or bool(t.get("token_extra_id"))
            level = b.get("cache_level", 0)
            out.append(
                BlockStored(
                    block_hashes=(h,),
                    parent_hash=parent,
                    token_ids=ids,
                    block_size=max(1, len(ids)),
                    medium="GPU" if not level else "CPU",
                    has_extra_keys=extra,
                )
            )
            parent = h
        return out
    if kind == "updated":
        return None
    raise DecodeError("malformed", f"unknown type {kind!r}")


class TrtllmHttpSource:
    """Polls one trtllm-serve and applies its events in id order."""

    def __init__(
        self, cfg: SourceConfig, limits: LimitsConfig, tracker: BlockChainTracker, metrics: ListenerMetrics
    ) -> None:
        self.cfg = cfg
        self.limits = limits
        self.tracker = tracker
        self.metrics = metrics
        self.name = cfg.backend_name
        self.last_event_id: int | None = None
        self.connected = False
        self.ever_connected = False
        self.state_since = time.monotonic()  # when the last poll result changed connected
        self.last_event_at: float | None = None
        self.max_response_bytes = limits.max_message_bytes  # a larger response is dropped: state cleared
        assert cfg.http_endpoint is not None
        self.url = cfg.http_endpoint.rstrip("/") + "/kv_cache_events"

    # -- the EventSource protocol: polls need nothing opened, nothing queued, nothing persisted ------------------
    @property
    def endpoint(self) -> str:
        assert self.cfg.http_endpoint is not None  # validated by SourceConfig
        return self.cfg.http_endpoint

    @property
    def backlog_bytes(self) -> None:
        return None

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def persistence(self) -> PersistedSource | None:
        return None

    def _drop(self, reason: str, n: int = 1) -> None:
        self.metrics.events_dropped.labels(self.name, reason).inc(n)

    def host_allowed(self) -> bool:
        allowed = self.cfg.allowed_publishers
        return not allowed or (urlsplit(self.url).hostname or "") in allowed

    async def run(self) -> None:
        """Poll until cancelled; errors are logged and retried at the poll interval."""
        if not self.host_allowed():
            log.error("event=publisher_not_allowed source=%s url=%s action=not_polling", self.name, self.url)
            self._drop("publisher_not_allowed")
            return
        timeout = aiohttp.ClientTimeout(total=max(5.0, self.cfg.poll_interval_ms / 1000 * 4))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self.cfg.poll_interval_ms / 1000)

    def _set_connected(self, value: bool) -> None:
        if value != self.connected:
            self.state_since = time.monotonic()
        self.connected = value
        self.ever_connected = self.ever_connected or value

    async def _read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """The whole body, or max_response_bytes + 1 bytes when it is larger (read() may return less than
        asked: only what has arrived)."""
        limit = self.max_response_bytes
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = await resp.content.read(min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        """One POST; a failure only marks the source disconnected."""
        try:
            async with session.post(self.url, json={}) as resp:
                if resp.status != 200:
                    self._set_connected(False)
                    self._drop("http_error")
                    return
                body = await self._read_body(resp)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if self.connected:
                log.warning("event=poll_failed source=%s error=%s", self.name, type(exc).__name__)
            self._set_connected(False)
            return
        self._set_connected(True)
        if len(body) > self.max_response_bytes:
            self._drop("too_large")
            self.tracker.reset("gap")  # events were lost
            return
        self.apply_body(body)

    def apply_body(self, body: bytes) -> None:
        """Apply one poll response (a JSON list of events)."""
        try:
            events = json.loads(body) if body.strip() else []
        except (ValueError, UnicodeDecodeError):
            self._drop("malformed")
            return
        if not isinstance(events, list):
            self._drop("malformed")
            return
        self.metrics.messages_received.labels(self.name).inc()
        if events:
            self.last_event_at = time.monotonic()
        for item in events:
            self._apply_item(item)

    def _apply_item(self, item: Any) -> None:
        if (
            not isinstance(item, dict)
            or isinstance(item.get("event_id"), bool)
            or not isinstance(item.get("event_id"), int)
        ):
            self._drop("malformed")
            return
        eid: int = item["event_id"]
        last = self.last_event_id
        if last is not None:
            if eid <= last:
                if eid == 0 and last > 0:
                    self.metrics.restarts.labels(self.name).inc()
                    self.tracker.reset("restart")
                else:
                    self._drop("duplicate")
                    return
            elif eid > last + 1:
                self.metrics.gaps.labels(self.name).inc()
                log.warning("event=event_id_gap source=%s last=%d id=%d action=clear", self.name, last, eid)
                self.tracker.reset("gap")
        self.last_event_id = eid
        self.metrics.events_received.labels(self.name).inc()
        try:
            decoded = decode_trtllm_event(item.get("data"), self.limits.max_event_tokens)
        except DecodeError as exc:
            self._drop(exc.reason)
            return
        if decoded is None:
            self._drop("unknown_event")
            return
        for ev in decoded:
            self.tracker.apply(ev)
        self.metrics.events_processed.labels(self.name).inc()

    def status(self, stale_after: float) -> dict[str, object]:
        """Health detail; ``connected`` means the last poll succeeded."""
        out = source_status(
            self.connected, self.connected, self.ever_connected, self.state_since, self.last_event_at, stale_after
        )
        return {**out, "last_seq": self.last_event_id}
