"""The receiving half of a ZMQ source: the SUB socket and its monitor, drained into a queue bounded in bytes,
and the true connection state (a peer counts once its ZMTP handshake succeeded). The applying half, in order,
is ``listener.zmq_source``. See docs/listener.md#the-zmq-source.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import zmq as _zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from listener.config import LimitsConfig, SourceConfig
from listener.metrics import ListenerMetrics

log = logging.getLogger("kv_listener.zmq")
# pyzmq is skipped by the project's mypy config (follow_imports=skip), so its constants are typed Any here
Z: Any = _zmq

MAX_RCV_HWM = 1000
READ_BURST = 256  # messages read in a row before the loop gets a turn
MESSAGE_OVERHEAD = 64  # bytes counted per queued message besides its payload
VERIFY = object()  # queue marker: a new connection; check the incarnation before the next message


def rcv_hwm(limits: LimitsConfig) -> int:
    """libzmq's receive queue in messages: at most this × max_message_bytes bytes wait inside libzmq."""
    return max(2, min(MAX_RCV_HWM, limits.max_backlog_bytes // limits.max_message_bytes))


def ipv6(endpoint: str | None) -> bool:
    """A tcp endpoint whose host is an IPv6 literal (``tcp://[ip]:port``)."""
    return bool(endpoint) and "://[" in (endpoint or "")


class ZmqReceiver:
    """One source's SUB socket and monitor: ``read_loop`` queues ``(seq, payload)`` items and ``VERIFY`` markers
    (bound: ``limits.max_backlog_bytes``), ``get`` hands them out in order, ``release`` returns their bytes."""

    def __init__(
        self, cfg: SourceConfig, limits: LimitsConfig, metrics: ListenerMetrics, ctx: zmq.asyncio.Context
    ) -> None:
        self.cfg = cfg
        self.limits = limits
        self.metrics = metrics
        self.ctx = ctx
        self.name = cfg.backend_name
        self.bound_endpoint: str | None = None  # set when zmq_mode is bind (resolves port 0 / *)
        # A peer counts once its ZMTP handshake succeeded: a TCP connection alone may be the socket connected
        # to itself (loopback, a port nobody listens on) or another protocol. With several TCP connections
        # (bind mode) a drop of one not yet handshaken is not told apart: peers ≤ TCP connections.
        self.peers = 0
        self._tcp = 0
        self.ever_connected = False
        self.state_since = time.monotonic()  # when the source last lost its peer (or started)
        self.backlog_bytes = 0  # bytes queued, not yet released by the applier
        self._queue: deque[tuple[Any, int]] = deque()
        self._wake = asyncio.Event()
        self._allowed = frozenset(cfg.allowed_publishers)
        self._sock: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None

    @property
    def connected(self) -> bool:
        return self.peers > 0

    @property
    def opened(self) -> bool:
        return self._sock is not None

    def open(self) -> None:
        """Create and bind/connect the SUB socket and its monitor (synchronous: callers learn the port).
        Raises ``zmq.ZMQError``."""
        sock = self.ctx.socket(Z.SUB)
        sock.setsockopt(Z.LINGER, 0)
        if ipv6(self.cfg.zmq_endpoint):
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

    def _drop(self, reason: str) -> None:
        self.metrics.events_dropped.labels(self.name, reason).inc()

    def peer_allowed(self, frame: Any) -> bool:
        """Whether the publisher of ``frame`` is in ``allowed_publishers`` (an empty list allows any)."""
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
                self._enqueue(VERIFY, 0)
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

    async def get(self) -> tuple[Any, int]:
        """The next queued item and its size in bytes (give the size back with ``release`` once applied)."""
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        return self._queue.popleft()

    def release(self, size: int) -> None:
        self.backlog_bytes -= size

    async def read_loop(self) -> None:
        """Drain the socket and its monitor into the queue until cancelled (the socket must be open)."""
        sock, mon = self._sock, self._mon
        assert sock is not None and mon is not None
        poller = zmq.asyncio.Poller()
        poller.register(sock, Z.POLLIN)
        poller.register(mon, Z.POLLIN)
        limit = self.limits.max_backlog_bytes
        sub_now, mon_now = Z.Socket.shadow(sock.underlying), Z.Socket.shadow(mon.underlying)  # non-blocking reads
        while True:
            await poller.poll()
            for _ in range(READ_BURST):  # a bounded burst, then the loop gets a turn
                self._monitor_events(mon_now)  # before each message: a reconnection is queued before its data
                if not sub_now.getsockopt(Z.EVENTS) & Z.POLLIN:
                    break
                frames = sub_now.recv_multipart(Z.NOBLOCK, copy=False)
                self.metrics.messages_received.labels(self.name).inc()
                if len(frames) != 3 or len(frames[1].bytes) != 8:
                    self._drop("malformed")
                    continue
                if not self.peer_allowed(frames[0]):
                    self._drop("publisher_not_allowed")
                    continue
                payload = frames[2].bytes
                size = len(payload) + MESSAGE_OVERHEAD
                if self.backlog_bytes + size > limit:
                    self._drop("backlog_full")
                    continue
                self._enqueue((int.from_bytes(frames[1].bytes, "big"), payload), size)
            await asyncio.sleep(0)
