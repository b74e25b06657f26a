"""vLLM / SGLang event source over ZMQ: SUB socket, sequence tracking, replay over ROUTER.

Messages are ``[topic, seq (8 bytes BE), msgpack payload]``. A sequence that goes back means the
engine restarted (its state is forgotten); a sequence that jumps is a gap: missed batches are fetched
from the engine's replay ROUTER (a DEALER sends ``[b"", start_seq]``; replies ``[seq, payload]`` or
``[topic, seq, payload]``, with or without a leading empty frame, until seq = ff*8 with an empty
payload). If the replay is not configured or does not cover the gap, the source's state is cleared.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq as _zmq
import zmq.asyncio

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.events import DecodeError
from listener.metrics import ListenerMetrics
from listener.msgpack_decoder import decode_batch

log = logging.getLogger("kv_listener.zmq")
# pyzmq is skipped by the project's mypy config (follow_imports=skip), so its constants are typed Any here
Z: Any = _zmq

END_SEQ = b"\xff" * 8
RCV_HWM = 10_000  # messages queued in libzmq per SUB socket; beyond it ZMQ drops → a gap → replay
MAX_REPLAY_MESSAGES = 100_000  # a larger gap is not replayed: the state is cleared instead


def split_replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq8, payload) from any accepted replay reply layout, or None when it is not one."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:  # [b"", seq, payload] or [topic, seq, payload]: seq is always frame 1
        return frames[1], frames[2]
    if len(frames) == 2:
        return frames[0], frames[1]
    return None


class ZmqEventSource:
    """One engine's ZMQ event stream applied to a BlockChainTracker, in sequence order."""

    def __init__(
        self,
        cfg: SourceConfig,
        limits: LimitsConfig,
        tracker: BlockChainTracker,
        metrics: ListenerMetrics,
        ctx: zmq.asyncio.Context,
    ) -> None:
        self.cfg = cfg
        self.limits = limits
        self.tracker = tracker
        self.metrics = metrics
        self.ctx = ctx
        self.name = cfg.backend_name
        self.last_seq: int | None = None
        self._last_payload_digest: int | None = None  # tells a restart at the same seq from a duplicate
        self.bound_endpoint: str | None = None  # set when zmq_mode is bind (resolves port 0 / *)
        self.connected = False
        self._allowed = frozenset(cfg.allowed_publishers)
        self._sock: zmq.asyncio.Socket | None = None

    def open(self) -> None:
        """Create and bind/connect the SUB socket (synchronous, so callers know the bound port)."""
        sock = self.ctx.socket(Z.SUB)
        sock.setsockopt(Z.LINGER, 0)
        sock.setsockopt(Z.RCVHWM, RCV_HWM)
        sock.setsockopt(Z.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(Z.SUBSCRIBE, self.cfg.topic.encode())
        assert self.cfg.zmq_endpoint is not None  # validated by SourceConfig
        if self.cfg.zmq_mode == "bind":
            sock.bind(self.cfg.zmq_endpoint)
            last = sock.getsockopt(Z.LAST_ENDPOINT)
            self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
        else:
            sock.connect(self.cfg.zmq_endpoint)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _drop(self, reason: str, n: int = 1) -> None:
        self.metrics.events_dropped.labels(self.name, reason).inc(n)

    def _peer_allowed(self, frame: Any) -> bool:
        if not self._allowed:
            return True
        try:
            peer = frame.get("Peer-Address")
        except (Z.ZMQError, AttributeError, TypeError):
            return False  # ipc/inproc expose no peer address: an allow-list cannot be satisfied
        return str(peer) in self._allowed

    async def run(self) -> None:
        """Receive until cancelled. Nothing an engine sends can end this loop."""
        if self._sock is None:
            self.open()
        sock = self._sock
        assert sock is not None
        self.connected = True
        log.info(
            "event=source_started source=%s engine=%s endpoint=%s",
            self.name,
            self.cfg.engine,
            self.cfg.zmq_endpoint,
        )
        try:
            while True:
                frames = await sock.recv_multipart(copy=False)
                try:
                    await self.handle(frames)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not kill the source; count it and go on
                    log.exception("event=handle_failed source=%s", self.name)
                    self._drop("internal_error")
        finally:
            self.connected = False
            self.close()

    async def handle(self, frames: list[Any]) -> None:
        """Process one SUB message."""
        self.metrics.messages_received.labels(self.name).inc()
        if len(frames) != 3:
            self._drop("malformed")
            return
        if not self._peer_allowed(frames[0]):
            self._drop("publisher_not_allowed")
            return
        seq_b = frames[1].bytes
        if len(seq_b) != 8:
            self._drop("malformed")
            return
        seq = int.from_bytes(seq_b, "big")
        payload = frames[2].bytes
        if not await self._accept_seq(seq, payload):
            return
        self.last_seq = seq
        self._last_payload_digest = hash(payload)
        self.apply_payload(payload)

    def apply_payload(self, payload: bytes) -> None:
        """Decode one batch and apply its events (bad events are counted and skipped)."""
        try:
            batch = decode_batch(payload, self.cfg.engine, self.limits.max_event_tokens)
        except DecodeError as exc:
            self._drop(exc.reason)
            return
        for reason in batch.dropped:
            self._drop(reason)
        if batch.ignored:
            self._drop("unknown_event", batch.ignored)
        self.metrics.events_received.labels(self.name).inc(len(batch.events) + len(batch.dropped))
        for ev in batch.events:
            self.tracker.apply(ev)
        self.metrics.events_processed.labels(self.name).inc(len(batch.events))

    async def _accept_seq(self, seq: int, payload: bytes) -> bool:
        last = self.last_seq
        if last is None or seq == last + 1:
            return True
        if seq == last and hash(payload) == self._last_payload_digest:
            self._drop("duplicate")
            return False
        # A sequence that goes back -- or repeats with another payload (an engine that published only
        # seq 0 before restarting starts again at seq 0) -- is a restart.
        if seq <= last:
            self.metrics.restarts.labels(self.name).inc()
            log.warning("event=engine_restart source=%s last_seq=%d seq=%d action=clear", self.name, last, seq)
            self.tracker.reset("restart")
            return True
        self.metrics.gaps.labels(self.name).inc()
        log.warning("event=sequence_gap source=%s last_seq=%d seq=%d", self.name, last, seq)
        if not await self._replay(last + 1, seq):
            self.tracker.reset("gap")
        return True

    async def _replay(self, start: int, until: int) -> bool:
        """Apply batches start..until-1 from the replay ROUTER; True when all of them were applied."""
        if not self.cfg.replay_endpoint or until - start > MAX_REPLAY_MESSAGES:
            self.metrics.replays.labels(self.name, "skipped").inc()
            return False
        dealer = self.ctx.socket(Z.DEALER)
        dealer.setsockopt(Z.LINGER, 0)
        dealer.setsockopt(Z.MAXMSGSIZE, self.limits.max_message_bytes)
        expected = start
        timeout_ms = self.cfg.replay_timeout_ms
        try:
            dealer.connect(self.cfg.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(until - start + 2):
                if not await dealer.poll(timeout_ms, Z.POLLIN):
                    break
                reply = split_replay_reply(list(await dealer.recv_multipart()))
                if reply is None:
                    self._drop("malformed")
                    continue
                seq_b, payload = reply
                if seq_b == END_SEQ or len(seq_b) != 8:
                    break
                seq = int.from_bytes(seq_b, "big")
                if seq < expected:
                    continue  # older than asked: already applied
                if seq != expected or seq >= until:
                    break
                self.apply_payload(payload)
                self.last_seq = seq
                self._last_payload_digest = hash(payload)
                expected += 1
                if expected == until:
                    break
        except Z.ZMQError as exc:
            log.warning("event=replay_failed source=%s error=%s", self.name, exc)
        finally:
            dealer.close(linger=0)
        ok = expected == until
        self.metrics.replays.labels(self.name, "ok" if ok else "incomplete").inc()
        log.info(
            "event=replay source=%s start=%d until=%d applied=%d ok=%s",
            self.name,
            start,
            until,
            expected - start,
            ok,
        )
        return ok
