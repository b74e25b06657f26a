"""vLLM / SGLang event source over ZMQ: SUB socket, sequence tracking, incarnation checks, replay.

Messages are ``[topic, seq (8 bytes BE), msgpack payload]`` (docs/wire.md §3). Three tasks per source:

- the reader drains the SUB socket (and its socket monitor) into a queue bounded in bytes
  (``limits.max_backlog_bytes``; a message that does not fit is dropped, reason ``backlog_full``: a gap,
  repaired by replay). RCVHWM is ``max(2, max_backlog_bytes // max_message_bytes)`` capped at 1000, so
  libzmq holds at most RCVHWM × max_message_bytes more; the publisher keeps its own SNDHWM queue.
- the socket monitor gives the true connection state: ``connected`` only while a peer is connected
  (EVENT_HANDSHAKE_SUCCEEDED .. EVENT_DISCONNECTED: a ZMTP peer, not just a TCP connection). The
  reader reads monitor events before each message, so a reconnection is queued before the first
  message that came over it.
- the applier applies messages in order, a batch in work units of ``limits.apply_slice_blocks`` blocks
  (``block_chains.work_units``), and yields to the loop between units (every few ms), so /healthz
  answers while a big batch is applied (decoding one message is one step: max_message_bytes bounds it).

Incarnation checks. The digest of the last applied batch is kept. After a reconnection, a listener start
with persisted state (``state_store``) or a sequence gap, the replay ROUTER is asked from the last applied
seq: the same seq with the same digest proves the same incarnation and the rest of the reply is applied
(catch-up); a different digest, or no batch at that seq while the engine answers (its seq went back),
is a restart: the old incarnation is cleared before anything new is applied, then the new one is replayed
from its earliest buffered seq. No replay endpoint, no answer within ``replay_timeout_ms``, or a buffer
that no longer holds the seq (rolled over) is unverifiable: cleared too (a route on blocks of a dead
incarnation is worse than a missed hit). On the live stream a seq that goes back (or repeats with another
payload) is a restart. A source without state that first sees seq s > 0 replays 0..s-1 from the engine
(a late start catches up on blocks vLLM will never re-announce); applying any contiguous suffix of the
engine's current batches is sound: it never claims a block the engine no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import zmq as _zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.events import DecodeError, source_status
from listener.metrics import ListenerMetrics
from listener.msgpack_decoder import DecodedBatch, decode_batch
from listener.state_store import EventLog, SourceState, batch_payload, payload_digest

log = logging.getLogger("kv_listener.zmq")
# pyzmq is skipped by the project's mypy config (follow_imports=skip), so its constants are typed Any here
Z: Any = _zmq

END_SEQ = b"\xff" * 8
MAX_RCV_HWM = 1000
MAX_REPLAY_MESSAGES = 100_000  # one replay applies at most this many batches
YIELD_EVERY_SECONDS = 0.005  # the applier gives the loop a turn at least this often
THREAD_DECODE_BYTES = 256 << 10  # payloads larger than this are decoded in a worker thread
RESTORE_EVENTS_PER_BATCH = 512
_VERIFY = object()  # queue marker: a new connection; check the incarnation before the next message


def rcv_hwm(limits: LimitsConfig) -> int:
    """libzmq's receive queue in messages: at most this × max_message_bytes bytes wait inside libzmq."""
    return max(2, min(MAX_RCV_HWM, limits.max_backlog_bytes // limits.max_message_bytes))


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


def split_replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq8, payload) from any accepted replay reply layout, or None when it is not one."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:  # [b"", seq, payload] or [topic, seq, payload]: seq is always frame 1
        return frames[1], frames[2]
    if len(frames) == 2:
        return frames[0], frames[1]
    return None


def _ipv6(endpoint: str | None) -> bool:
    """A tcp endpoint whose host is an IPv6 literal (``tcp://[ip]:port``)."""
    return bool(endpoint) and "://[" in (endpoint or "")


def fingerprint(cfg: SourceConfig) -> str:
    """What identifies the engine behind a source (persisted state of another engine is not restored)."""
    return f"{cfg.engine}|{cfg.zmq_endpoint}|{cfg.topic}|{cfg.model}"


class _ReplayEnd(Exception):
    """The replay stream ended: ``status`` is end, timeout, error or limit."""


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
        self.bound_endpoint: str | None = None  # set when zmq_mode is bind (resolves port 0 / *)
        # A peer counts once its ZMTP handshake succeeded: a TCP connection alone may be the socket connected
        # to itself (loopback, a port nobody listens on) or another protocol. With several TCP connections
        # (bind mode) a drop of one not yet handshaken is not told apart: peers ≤ TCP connections.
        self.peers = 0
        self._tcp = 0
        self.ever_connected = False
        self.state_since = time.monotonic()  # when the source last lost its peer (or started)
        self.last_event_at: float | None = None
        self.incarnation_checks: dict[str, int] = {"same": 0, "restart": 0, "unverifiable": 0}
        self.backlog_bytes = 0
        self._turn = 0.0  # loop time by which the applier next yields (see _give_turn)
        self._queue: deque[Any] = deque()
        self._wake = asyncio.Event()
        self._allowed = frozenset(cfg.allowed_publishers)
        self._sock: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None

    @property
    def connected(self) -> bool:
        return self.peers > 0

    # -- sockets ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Create and bind/connect the SUB socket and its monitor (synchronous: callers learn the port)."""
        sock = self.ctx.socket(Z.SUB)
        sock.setsockopt(Z.LINGER, 0)
        if _ipv6(self.cfg.zmq_endpoint):
            sock.setsockopt(Z.IPV6, 1)  # libzmq refuses an IPv6 address unless asked (a discovered pod's may be one)
        sock.setsockopt(Z.RCVHWM, rcv_hwm(self.limits))
        sock.setsockopt(Z.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(Z.SUBSCRIBE, self.cfg.topic.encode())
        self._sock = sock
        self._mon = sock.get_monitor_socket(
            Z.EVENT_CONNECTED | Z.EVENT_ACCEPTED | Z.EVENT_HANDSHAKE_SUCCEEDED | Z.EVENT_DISCONNECTED
        )
        assert self.cfg.zmq_endpoint is not None  # validated by SourceConfig
        if self.cfg.zmq_mode == "bind":
            sock.bind(self.cfg.zmq_endpoint)
            last = sock.getsockopt(Z.LAST_ENDPOINT)
            self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
        else:
            sock.connect(self.cfg.zmq_endpoint)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Z.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._mon is not None:
            self._mon.close(linger=0)
            self._mon = None
        self.peers = self._tcp = 0

    def _drop(self, reason: str, n: int = 1) -> None:
        self.metrics.events_dropped.labels(self.name, reason).inc(n)

    def _peer_allowed(self, frame: Any) -> bool:
        if not self._allowed:
            return True
        try:
            peer = frame.get("Peer-Address")
        except (Z.ZMQError, AttributeError, TypeError):
            return False  # ipc/inproc expose no peer address: an allow-list cannot be satisfied
        peer = str(peer)
        if peer.startswith("::ffff:") and "." in peer:  # an IPv4 peer on a dual-stack socket: its IPv4 form counts
            return peer in self._allowed or peer[7:] in self._allowed
        return peer in self._allowed

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
        if self._sock is None:
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
                tg.create_task(self._read_loop(), name=f"zmq-read-{self.name}")
                tg.create_task(self._apply_loop(), name=f"zmq-apply-{self.name}")
        finally:
            self.close()

    def _monitor_events(self, mon: Any) -> None:
        while mon.getsockopt(Z.EVENTS) & Z.POLLIN:
            ev = parse_monitor_message(mon.recv_multipart(Z.NOBLOCK))
            kind = ev["event"]
            if kind in (Z.EVENT_CONNECTED, Z.EVENT_ACCEPTED):
                self._tcp += 1
            elif kind == Z.EVENT_HANDSHAKE_SUCCEEDED:
                self.peers = min(self.peers + 1, self._tcp)
                self.ever_connected = True
                self.state_since = time.monotonic()
                log.info("event=peer_connected source=%s peers=%d", self.name, self.peers)
                self._enqueue(_VERIFY, 0)
            elif kind == Z.EVENT_DISCONNECTED:
                self._tcp = max(0, self._tcp - 1)
                if self.peers > self._tcp:
                    self.peers = self._tcp
                    if not self.peers:
                        self.state_since = time.monotonic()
                    log.info("event=peer_disconnected source=%s peers=%d", self.name, self.peers)

    def _enqueue(self, item: Any, size: int) -> None:
        self._queue.append((item, size))
        self.backlog_bytes += size
        self._wake.set()

    async def _read_loop(self) -> None:
        sock, mon = self._sock, self._mon
        assert sock is not None and mon is not None
        poller = zmq.asyncio.Poller()
        poller.register(sock, Z.POLLIN)
        poller.register(mon, Z.POLLIN)
        limit = self.limits.max_backlog_bytes
        sub_now, mon_now = Z.Socket.shadow(sock.underlying), Z.Socket.shadow(mon.underlying)  # non-blocking reads
        while True:
            await poller.poll()
            for _ in range(256):  # a bounded burst, then the loop gets a turn
                self._monitor_events(mon_now)  # before each message: a reconnection is queued before its data
                if not sub_now.getsockopt(Z.EVENTS) & Z.POLLIN:
                    break
                frames = sub_now.recv_multipart(Z.NOBLOCK, copy=False)
                self.metrics.messages_received.labels(self.name).inc()
                if len(frames) != 3 or len(frames[1].bytes) != 8:
                    self._drop("malformed")
                    continue
                if not self._peer_allowed(frames[0]):
                    self._drop("publisher_not_allowed")
                    continue
                payload = frames[2].bytes
                size = len(payload) + 64
                if self.backlog_bytes + size > limit:
                    self._drop("backlog_full")
                    continue
                self._enqueue((int.from_bytes(frames[1].bytes, "big"), payload), size)
            await asyncio.sleep(0)

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
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            item, size = self._queue.popleft()
            try:
                if item is _VERIFY:
                    self._live_seq = self._live_digest = None
                    if self.last_seq is not None or self._restored is not None:
                        await self._guarded(self._resync("reconnect"))
                else:
                    await self._guarded(self.handle(*item))
            finally:
                self.backlog_bytes -= size
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
    async def _replay(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """(seq, payload) replies from the replay ROUTER from ``start``; ends with _ReplayEnd(status)."""
        assert self.cfg.replay_endpoint
        dealer = self.ctx.socket(Z.DEALER)
        dealer.setsockopt(Z.LINGER, 0)
        if _ipv6(self.cfg.replay_endpoint):
            dealer.setsockopt(Z.IPV6, 1)
        dealer.setsockopt(Z.MAXMSGSIZE, self.limits.max_message_bytes)
        timeout_ms = self.cfg.replay_timeout_ms
        try:
            dealer.connect(self.cfg.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAY_MESSAGES):
                if not await dealer.poll(timeout_ms, Z.POLLIN):
                    raise _ReplayEnd("timeout")
                reply = split_replay_reply(list(await dealer.recv_multipart()))
                if reply is None or len(reply[0]) != 8:
                    self._drop("malformed")
                    raise _ReplayEnd("error")
                if reply[0] == END_SEQ:
                    raise _ReplayEnd("end")
                yield int.from_bytes(reply[0], "big"), reply[1]
            raise _ReplayEnd("limit")
        except Z.ZMQError as exc:
            log.warning("event=replay_failed source=%s error=%s", self.name, exc)
            raise _ReplayEnd("error") from None
        finally:
            dealer.close(linger=0)

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
        except _ReplayEnd as end:
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
        catch up; see the module docstring for the verdicts."""
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
            except _ReplayEnd as end:
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
        out = source_status(
            self.peers > 0, self.connected, self.ever_connected, self.state_since, self.last_event_at, stale_after
        )
        return {
            **out,
            "peers": self.peers,
            "last_seq": self.last_seq,
            "incarnation_checks": dict(self.incarnation_checks),
            "backlog_bytes": self.backlog_bytes,
            "restoring": self._restored is not None,
        }
