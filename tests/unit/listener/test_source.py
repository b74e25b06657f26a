"""listener.source: both sources keep the EventSource contract the app relies on: ``open`` raises
SourceOpenError (and leaves nothing open), ``close`` is idempotent, ``backlog_bytes`` and ``persistence`` say what
the source keeps, ``status`` has the fields /healthz reads; and a source the app has never seen (a fake here,
the gRPC source later) is run, counted and reported through the Protocol alone.

The tests that start a server or bind a socket: tests/integration/test_listener_source.py."""

from __future__ import annotations

import zmq
import zmq.asyncio

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.metrics import ListenerMetrics
from listener.source import EventSource
from listener.state_store import PersistedSource
from listener.trtllm_source import TrtllmHttpSource
from tests.support.listener_zmq_source import MODEL, zmq_source
from tests.support.recording_sink import RecordingSink


def trtllm_source() -> TrtllmHttpSource:
    cfg = SourceConfig(backend_name="t1", engine="trtllm", model=MODEL, http_endpoint="http://127.0.0.1:1")
    return TrtllmHttpSource(
        cfg, LimitsConfig(), BlockChainTracker(cfg, LimitsConfig(), RecordingSink()), ListenerMetrics()
    )


def contract(src: EventSource) -> dict[str, object]:
    st = src.status(60.0)
    assert isinstance(st["state_age_seconds"], float) and st["state"] in ("connecting", "connected", "disconnected")
    assert src.name == src.cfg.backend_name and src.endpoint in (src.cfg.zmq_endpoint, src.cfg.http_endpoint)
    return st


def test_what_each_source_keeps(ctx: zmq.asyncio.Context) -> None:
    z = zmq_source(ctx, "tcp://127.0.0.1:1")
    z.open()  # connect mode: nothing listens yet, nothing fails
    try:
        st = contract(z)
        assert st["state"] == "connecting" and st["backlog_bytes"] == 0 and z.backlog_bytes == 0
        state: PersistedSource | None = z.persistence()
        assert state is z and state.fingerprint() == "vllm|tcp://127.0.0.1:1||m"
    finally:
        z.close()
    t = trtllm_source()
    t.open()
    assert contract(t)["state"] == "connecting"
    assert t.backlog_bytes is None and t.persistence() is None
    t.close()
