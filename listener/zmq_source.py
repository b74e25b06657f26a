"""vLLM / SGLang event source over ZMQ: applies one engine's batches to its block-chain tracker in sequence
order, checks the engine's incarnation against its replay buffer (after a reconnection, a start with persisted
state, a sequence gap), catches up, and restores persisted state once the incarnation is proven. The socket side
is ``listener.zmq_receiver``, the replay client ``listener.zmq_replay``. See docs/listener.md#the-zmq-source.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import zmq as _zmq
import zmq.asyncio

from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.events import DecodeError, source_status
from listener.metrics import ListenerMetrics
from listener.msgpack_decoder import DecodedBatch, decode_batch
from listener.source import SourceOpenError
from listener.state_file import SourceState
from listener.state_log import EventLog, batch_payload
from listener.state_store import PersistedSource
from listener.zmq_receiver import VERIFY, ZmqReceiver
from listener.zmq_replay import ReplayEnd, replay

log = logging.getLogger("kv_listener.zmq")
Z: Any = _zmq  # pyzmq is typed Any (see listener.zmq_receiver)

YIELD_EVERY_SECONDS = 0.005  # the applier gives the loop a turn at least this often
THREAD_DECODE_BYTES = 256 << 10  # payloads larger than this are decoded in a worker thread
RESTORE_EVENTS_PER_BATCH = 512


def payload_digest(payload: bytes) -> bytes:
    """A stable digest of one batch payload (Python's hash() changes between processes)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def restore_chunks(events: list[bytes], limits: LimitsConfig) -> Iterator[list[bytes]]:
    """The persisted events in consecutive chunks the decoder's per-message budget always admits.

    Every msgpack object takes at least one byte and every container is an object, so a payload of B bytes
    builds at most B containers and B elements: a chunk of at most min(max_message_items,
    max_message_containers, max_message_bytes) // 2 packed bytes (half: room for the batch wrapper) always
    fits. A larger event goes alone: it passed the same budget alone when it was live, in a wrapper no
    smaller than ``batch_payload``'s. At most ``RESTORE_EVENTS_PER_BATCH`` events per chunk."""
    cap = max(1, min(limits.max_message_items, limits.max_message_containers, limits.max_message_bytes) // 2)
    chunk: list[bytes] = []
    size = 0
    for ev in events:
        if chunk and (size + len(ev) > cap or len(chunk) >= RESTORE_EVENTS_PER_BATCH):
            yield chunk
            chunk, size = [], 0
        chunk.append(ev)
        size += len(ev)
    if chunk:
        yield chunk


def fingerprint(cfg: SourceConfig) -> str:
    """What identifies the engine behind a source (persisted state of another engine is not restored)."""
    return f"{cfg.engine}|{cfg.zmq_endpoint}|{cfg.topic}|{cfg.model}"


class ZmqEventSource:
    """One engine's ZMQ event stream applied to a BlockChainTracker, in sequence order."""

    def __init__(
        self,
        cfg: SourceConfig,
        limits: LimitsConfig,
        tracker: BlockChainTracker,
        metrics: ListenerMetrics,
        ctx: zmq.asyncio.Context,
        keep_log: bool = False,
    ) -> None:
        self.cfg = cfg
        # the compacted event log exists only for the state file (state.path): without it, nothing records
        self.keep_log = keep_log
        self.limits = limits
        self.tracker = tracker
        self.metrics = metrics
        self.ctx = ctx
        self.name = cfg.backend_name
        self.last_seq: int | None = None  # last applied seq of the current incarnation
        self.last_digest: bytes | None = None
        self._live_seq: int | None = None  # last seq seen on the live stream of the current connection
        self._live_digest: bytes | None = None
        # what rebuilds the tracker after a listener restart (state_store); bounded to 4 entries per tracked block
        self.log = EventLog(
            max_entries=4 * limits.max_tracked_blocks,
            treat_eviction_as_offload=cfg.treat_eviction_as_offload,
            engine=cfg.engine,
        )
        self._restored: SourceState | None = None  # persisted state, applied once its incarnation is verified
        self.last_event_at: float | None = None
        self.incarnation_checks: dict[str, int] = {"same": 0, "restart": 0, "unverifiable": 0}
        self._turn = 0.0  # loop time by which the applier next yields (see _give_turn)
        self.receiver = ZmqReceiver(cfg, limits, metrics, ctx)

    # -- the EventSource protocol ------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self.cfg.zmq_endpoint is not None  # validated by SourceConfig
        return self.cfg.zmq_endpoint

    @property
    def connected(self) -> bool:
        return self.receiver.connected

    @property
    def peers(self) -> int:
        return self.receiver.peers

    @property
    def backlog_bytes(self) -> int:
        return self.receiver.backlog_bytes

    def open(self) -> None:
        """Open the SUB socket and its monitor (synchronous: callers learn the port); on failure the socket is
        closed and ``SourceOpenError`` raised."""
        try:
            self.receiver.open()
        except Z.ZMQError as exc:
            self.receiver.close()
            raise SourceOpenError(str(exc)) from None

    def close(self) -> None:
        self.receiver.close()

    def persistence(self) -> PersistedSource:
        return self

    def _drop(self, reason: str, n: int = 1) -> None:
        self.metrics.events_dropped.labels(self.name, reason).inc(n)

    # -- persisted state -------------------------------------------------------------------------
    def restore(self, state: SourceState) -> None:
        """Hand over persisted state: applied at run() once the engine proves the same incarnation."""
        if state.fingerprint != self.fingerprint() or state.last_seq is None or state.digest is None:
            return
        self._restored = state

    def fingerprint(self) -> str:
        return fingerprint(self.cfg)

    def persisted(self) -> tuple[int | None, bytes | None, list[bytes] | None]:
        """(last seq, digest, events or None for "the log's") to save now: the log is recorded with the
        seq between batches; persisted state not verified (or not yet re-applied) is saved as it was read."""
        if self._restored is not None:
            return self._restored.last_seq, self._restored.digest, self._restored.events
        return self.last_seq, self.last_digest, None

    # -- tasks -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Receive and apply until cancelled. Nothing an engine sends can end this."""
        if not self.receiver.opened:
            self.open()
        log.info(
            "event=source_started source=%s engine=%s endpoint=%s restored=%s",
            self.name,
            self.cfg.engine,
            self.cfg.zmq_endpoint,
            self._restored is not None,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.receiver.read_loop(), name=f"zmq-read-{self.name}")
                tg.create_task(self._apply_loop(), name=f"zmq-apply-{self.name}")
        finally:
            self.close()

    async def _give_turn(self) -> None:
        """Yield to the event loop once ``YIELD_EVERY_SECONDS`` of applying passed since the last turn, across
        batches too: a stream of small batches must not hold the loop any more than one big batch."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._turn:
            await asyncio.sleep(0)
            self._turn = loop.time() + YIELD_EVERY_SECONDS

    async def _apply_loop(self) -> None:
        if self._restored is not None:
            await self._guarded(self._resync("start"))
        while True:
            item, size = await self.receiver.get()
            try:
                if item is VERIFY:
                    self._live_seq = self._live_digest = None
                    if self.last_seq is not None or self._restored is not None:
                        await self._guarded(self._resync("reconnect"))
                else:
                    await self._guarded(self.handle(*item))
            finally:
                self.receiver.release(size)
            await self._give_turn()

    async def _guarded(self, work: Any) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not kill the source; count it and go on
            log.exception("event=handle_failed source=%s", self.name)
            self._drop("internal_error")

    # -- sequence --------------------------------------------------------------------------------
    async def handle(self, seq: int, payload: bytes) -> None:
        """Process one live message (seq, payload) in order."""
        digest = payload_digest(payload)
        self.last_event_at = time.monotonic()
        prev, prev_digest = self._live_seq, self._live_digest
        self._live_seq, self._live_digest = seq, digest
        if prev is not None and seq <= prev:
            if seq == prev and digest == prev_digest:
                self._drop("duplicate")
                return
            # A seq that goes back -- or repeats with another payload (an engine that published only seq 0
            # before restarting starts again at seq 0) -- is a restart.
            self.metrics.restarts.labels(self.name).inc()
            log.warning("event=engine_restart source=%s last_seq=%d seq=%d action=clear", self.name, prev, seq)
            self._clear("restart")
        elif self.last_seq is not None and seq <= self.last_seq:
            self._drop("duplicate")  # already applied from a replay
            return
        if self.last_seq is None:
            if seq > 0 and self.cfg.replay_endpoint:
                await self._catch_up(0, until=seq)  # a late start: the engine's blocks stored before now
        elif seq > self.last_seq + 1:
            self.metrics.gaps.labels(self.name).inc()
            log.warning("event=sequence_gap source=%s last_seq=%d seq=%d", self.name, self.last_seq, seq)
            await self._resync("gap", until=seq)
        if self.last_seq is not None:
            if seq <= self.last_seq:
                self._drop("duplicate")
                return
            if seq > self.last_seq + 1:  # batches in between are lost for good
                self._clear("gap")
        await self._apply(seq, payload, digest)

    def _clear(self, reason: str) -> None:
        self.tracker.reset(reason)
        self.log.reset()
        self.last_seq = self.last_digest = None
        self._restored = None

    async def _apply(self, seq: int, payload: bytes, digest: bytes) -> None:
        batch = await self.apply_payload(payload)
        if batch is not None and self.keep_log:  # a payload the decoder refused is never decoded again
            self.log.record_events(batch.raw_events)
        self.last_seq, self.last_digest = seq, digest

    async def apply_payload(self, payload: bytes) -> DecodedBatch | None:
        """Decode one batch and apply its events (bad events are counted and skipped) in work units of at
        most ``limits.apply_slice_blocks`` blocks, yielding to the loop between units once a few ms passed."""
        try:
            args = (payload, self.cfg.engine, self.limits.max_event_tokens, self.limits)
            if len(payload) > THREAD_DECODE_BYTES:  # decoding takes tens of ms: in a thread, the loop keeps
                batch = await asyncio.to_thread(decode_batch, *args)  # its turns (the decoder's hooks drop the GIL)
            else:
                batch = decode_batch(*args)
        except DecodeError as exc:
            self._drop(exc.reason)
            return None
        for reason in batch.dropped:
            self._drop(reason)
        if batch.ignored:
            self._drop("unknown_event", batch.ignored)
        self.metrics.events_received.labels(self.name).inc(len(batch.events) + len(batch.dropped))
        for unit in work_units(batch.events, self.limits.apply_slice_blocks):
            self.tracker.apply_all(unit)
            await self._give_turn()
        self.metrics.events_processed.labels(self.name).inc(len(batch.events))
        return batch

    # -- replay ----------------------------------------------------------------------------------
    def _replay(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """(seq, payload) replies of the engine's replay ROUTER from ``start``; ends with ReplayEnd(status)."""
        return replay(self.ctx, self.cfg, self.limits, start, lambda: self._drop("malformed"))

    async def _apply_stream(self, replies: AsyncIterator[tuple[int, bytes]], until: int | None) -> str:
        """Apply contiguous replies (from last_seq + 1, or from the first one when there is no last_seq)."""
        try:
            async for seq, payload in replies:
                if until is not None and seq >= until:
                    return "ok"
                if self.last_seq is not None and seq <= self.last_seq:
                    continue
                if self.last_seq is not None and seq != self.last_seq + 1:
                    return "incomplete"
                await self._apply(seq, payload, payload_digest(payload))
        except ReplayEnd as end:
            return "ok" if end.args[0] == "end" else "incomplete"
        return "ok"

    async def _catch_up(self, start: int, until: int | None = None) -> None:
        """With no state: apply the engine's buffered batches from ``start`` (a contiguous suffix)."""
        replies = self._replay(start)
        async with contextlib.aclosing(replies):
            result = await self._apply_stream(replies, until)
        self.metrics.replays.labels(self.name, result).inc()
        log.info("event=catch_up source=%s start=%d last_seq=%s result=%s", self.name, start, self.last_seq, result)

    async def _resync(self, cause: str, until: int | None = None) -> None:
        """Check the incarnation against the replay ROUTER from the last applied (or restored) seq and
        catch up; the verdicts are in docs/listener.md#incarnation-checks."""
        restored = self._restored
        ref_seq, ref_digest = (restored.last_seq, restored.digest) if restored else (self.last_seq, self.last_digest)
        assert ref_seq is not None
        if not self.cfg.replay_endpoint:
            if cause == "gap":
                self.metrics.replays.labels(self.name, "skipped").inc()
                return  # handle() clears: the batches in between are lost
            self._verdict(cause, "unverifiable", ref_seq, "no replay endpoint")
            self._clear("unverifiable")
            return
        replies = self._replay(ref_seq)
        async with contextlib.aclosing(replies):
            try:
                first: tuple[int, bytes] | None = await anext(replies)
                status = "reply"
            except ReplayEnd as end:
                first, status = None, end.args[0]
            if first is not None and first[0] == ref_seq and payload_digest(first[1]) == ref_digest:
                self._verdict(cause, "same", ref_seq, "digest matches")
                if restored is not None:
                    await self._apply_restored(restored)
                    self._restored = None
                result = await self._apply_stream(replies, until)
                self.metrics.replays.labels(self.name, result).inc()
                return
            if first is None and status != "end":
                self._verdict(cause, "unverifiable", ref_seq, f"replay {status}")
                self._clear("unverifiable")
                return
            if first is not None and first[0] > ref_seq:  # the buffer rolled over: cannot tell
                self._verdict(cause, "unverifiable", ref_seq, f"oldest buffered seq {first[0]}")
                self._clear("unverifiable")
                self.last_seq = None
                await self._apply(first[0], first[1], payload_digest(first[1]))  # the engine's current suffix
                result = await self._apply_stream(replies, until)
                self.metrics.replays.labels(self.name, result).inc()
                return
        why = "no batch at that seq" if first is None else "seq went back" if first[0] < ref_seq else "digest differs"
        self._verdict(cause, "restart", ref_seq, why)
        self.metrics.restarts.labels(self.name).inc()
        self._clear("restart")
        await self._catch_up(0, until)

    def _verdict(self, cause: str, verdict: str, ref_seq: int, why: str) -> None:
        self.incarnation_checks[verdict] += 1
        self.metrics.incarnation_checks.labels(self.name, verdict).inc()
        level = logging.INFO if verdict == "same" else logging.WARNING
        log.log(
            level,
            "event=incarnation_check source=%s cause=%s seq=%d verdict=%s why=%r",
            self.name,
            cause,
            ref_seq,
            verdict,
            why,
        )

    async def _apply_restored(self, st: SourceState) -> None:
        """Rebuild the tracker from the persisted (compacted) log; the log is rebuilt the same way.

        The events are applied in payloads the decoder's budget always admits (``restore_chunks``); a chunk
        refused anyway (limits lowered since the save) is applied event by event, and an event refused alone
        is counted (``state_restore_refused``) and logged: the rest of the state is still restored."""
        refused = 0
        for chunk in restore_chunks(st.events, self.limits):
            parts = [chunk]
            while parts:
                part = parts.pop()
                batch = await self.apply_payload(batch_payload(part))
                if batch is not None:
                    if self.keep_log:
                        self.log.record_events(batch.raw_events)
                elif len(part) > 1:
                    parts.extend([e] for e in reversed(part))  # in order, one by one
                else:
                    refused += 1
        if refused:
            self._drop("state_restore_refused", refused)
            log.warning("event=state_restore_refused source=%s events=%d", self.name, refused)
        self.last_seq, self.last_digest = st.last_seq, st.digest
        log.info("event=state_restored source=%s last_seq=%s events=%d", self.name, st.last_seq, len(st.events))

    # -- health ----------------------------------------------------------------------------------
    def status(self, stale_after: float) -> dict[str, object]:
        rx = self.receiver
        out = source_status(
            rx.peers > 0, rx.connected, rx.ever_connected, rx.state_since, self.last_event_at, stale_after
        )
        return {
            **out,
            "peers": self.peers,
            "last_seq": self.last_seq,
            "incarnation_checks": dict(self.incarnation_checks),
            "backlog_bytes": self.backlog_bytes,
            "restoring": self._restored is not None,
        }
