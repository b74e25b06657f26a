"""listener.grpc_feed in process (a gRPC server on loopback, real channels): ListBackends, a Subscribe's hello and
snapshot, the refusals (NOT_FOUND, UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the cap, UNAUTHENTICATED
without the token) and the setup errors that stop a start. Through the whole listener and the picker's consumer:
tests/integration/test_grpc_feed.py.

The tests that start a server or bind a socket: tests/integration/test_listener_grpc_feed_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from listener.config import FeedConfig, GrpcFeedConfig
from listener.grpc_feed import GrpcFeedServer, GrpcFeedSetupError
from listener.metrics import ListenerMetrics
from tests.support.listener_grpc_feed import Served


@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "No such file"), ("", "empty"), ("two\nlines\n", "not a one-line token"), ("x" * 5000, "one-line")],
)
async def test_an_unusable_token_file_stops_the_start(tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    s = Served(str(path))
    with pytest.raises(GrpcFeedSetupError, match=says):
        await s.server.start()
    assert s.server.port is None


async def test_an_unreadable_certificate_stops_the_start(tmp_path: Path) -> None:
    cfg = GrpcFeedConfig(listen="127.0.0.1:0", tls_cert_file=str(tmp_path / "no.pem"), tls_key_file=str(tmp_path / "k"))
    server = GrpcFeedServer({}, cfg, FeedConfig(), ListenerMetrics(), lambda: False)
    with pytest.raises(GrpcFeedSetupError, match=r"grpc\.tls_cert_file"):
        await server.start()
