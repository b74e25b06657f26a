"""listener.zmq_receiver over real ZMQ sockets: the true connection state (and what /healthz makes of it),
staleness, the receive backlog bound, the publisher allow-list, bind mode.

The tests that start a server or bind a socket: tests/integration/test_listener_zmq_receiver.py."""

from __future__ import annotations

import zmq
import zmq.asyncio

from listener.config import LimitsConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.zmq_receiver import MAX_RCV_HWM, ZmqReceiver, ipv6, rcv_hwm

MODEL = "m"


def test_an_ipv4_peer_on_a_dual_stack_socket_matches_its_ipv4_allow_entry(ctx: zmq.asyncio.Context) -> None:
    """libzmq reports an IPv4 peer of an IPv6-enabled socket as ::ffff:a.b.c.d: the allow-list's a.b.c.d admits it."""

    class Frame:
        def __init__(self, peer: str) -> None:
            self.peer = peer

        def get(self, _: str) -> str:
            return self.peer

    cfg = SourceConfig(backend_name="e1", model=MODEL, zmq_endpoint="tcp://x:1", allowed_publishers=("10.1.2.3",))
    rx = ZmqReceiver(cfg, LimitsConfig(), ListenerMetrics(), ctx)
    assert rx.peer_allowed(Frame("::ffff:10.1.2.3"))
    assert rx.peer_allowed(Frame("10.1.2.3"))
    assert not rx.peer_allowed(Frame("::ffff:10.1.2.4"))
    assert not rx.peer_allowed(Frame("fd00::10.1.2.3"))


def test_receive_queue_bounds_and_ipv6_endpoints() -> None:
    assert rcv_hwm(LimitsConfig(max_backlog_bytes=1 << 16, max_message_bytes=1 << 15)) == 2
    assert rcv_hwm(LimitsConfig(max_backlog_bytes=1 << 16, max_message_bytes=1 << 20)) == 2  # at least 2
    assert rcv_hwm(LimitsConfig(max_backlog_bytes=1 << 34, max_message_bytes=1024)) == MAX_RCV_HWM
    assert rcv_hwm(LimitsConfig()) == 8  # 64 MiB over 8 MiB messages
    assert ipv6("tcp://[::1]:5557") and not ipv6("tcp://10.0.0.1:5557") and not ipv6(None)
