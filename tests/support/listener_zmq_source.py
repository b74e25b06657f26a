"""A listener ZmqEventSource (backend z1) on an endpoint, connecting or binding."""

from __future__ import annotations

import zmq
import zmq.asyncio

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.zmq_source import ZmqEventSource
from tests.support.recording_sink import RecordingSink

MODEL = "m"


def zmq_source(ctx: zmq.asyncio.Context, endpoint: str, mode: str = "connect") -> ZmqEventSource:
    cfg = SourceConfig(backend_name="z1", model=MODEL, zmq_endpoint=endpoint, zmq_mode=mode)  # type: ignore[arg-type]
    tracker = BlockChainTracker(cfg, LimitsConfig(), RecordingSink())
    return ZmqEventSource(cfg, LimitsConfig(), tracker, ListenerMetrics(), ctx)
