"""listener.grpc_feed in process (a gRPC server on loopback, real channels): ListBackends, a Subscribe's hello and
snapshot, the refusals (NOT_FOUND, UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the cap, UNAUTHENTICATED
without the token) and the setup errors that stop a start. Through the whole listener and the picker's consumer:
tests/integration/test_grpc_feed.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from listener.config import FeedConfig, GrpcFeedConfig
from listener.feed import BackendFeed
from listener.grpc_feed import GrpcFeedServer, GrpcFeedSetupError
from listener.metrics import ListenerMetrics
from picker.shared.feed_records import GRPC_LIST_BACKENDS, GRPC_SUBSCRIBE
from picker.shared.kvfeed_pb import feed_pb2 as pb

TOKEN = "s3cret-token"


class Served:
    def __init__(self, token_file: str | None = None) -> None:
        self.feed_cfg = FeedConfig(max_keys_per_record=2, max_subscribers_per_backend=1, keepalive_seconds=60)
        self.feeds = {"e1": BackendFeed("e1", self.feed_cfg, base_id=3 << 40, model="m", engine="sglang")}
        self.refusing = False
        self.server = GrpcFeedServer(
            self.feeds,
            GrpcFeedConfig(listen="127.0.0.1:0", token_file=token_file),
            self.feed_cfg,
            ListenerMetrics(),
            lambda: self.refusing,
        )

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    s = Served(str(token))
    await s.server.start()
    try:
        yield s
    finally:
        await s.server.stop(grace=0)


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def list_backends(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(
        GRPC_LIST_BACKENDS,
        request_serializer=pb.ListBackendsRequest.SerializeToString,
        response_deserializer=pb.ListBackendsResponse.FromString,
    )


def subscribe(channel: grpc.aio.Channel, backend: str, metadata: Any = AUTH) -> Any:
    return channel.unary_stream(
        GRPC_SUBSCRIBE,
        request_serializer=pb.SubscribeRequest.SerializeToString,
        response_deserializer=pb.FeedRecord.FromString,
    )(pb.SubscribeRequest(backend=backend), metadata=metadata)


async def refused(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in call:
            pass
    code: grpc.StatusCode = exc.value.code()
    return code


async def test_list_backends_needs_the_token(served: Served) -> None:
    served.feeds["e1"].emit("put", [1, 2, 3], "gpu_hot")
    async with served.channel() as channel:
        reply = await list_backends(channel)(pb.ListBackendsRequest(), metadata=AUTH)
        (info,) = reply.backends
        assert (info.backend, info.model, info.engine, info.entries) == ("e1", "m", "sglang", 3)
        assert info.last_id == served.feeds["e1"].last_id and info.subscribers == 0
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await list_backends(channel)(pb.ListBackendsRequest(), metadata=metadata)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_subscribe_starts_with_hello_and_a_snapshot(served: Served) -> None:
    served.feeds["e1"].emit("put", [1, 2, 3], "gpu_hot")
    async with served.channel() as channel:
        call = subscribe(channel, "e1")
        records = []
        async for rec in call:
            records.append(rec)
            if rec.WhichOneof("body") == "snapshot_end":
                break
        call.cancel()
    assert [r.WhichOneof("body") for r in records] == ["hello", "snapshot_begin", "put", "put", "snapshot_end"]
    assert records[0].hello.backend == "e1" and not records[0].hello.resumed
    assert records[1].snapshot_begin.entries == 3


async def test_refusals(served: Served) -> None:
    async with served.channel() as channel:
        assert await refused(subscribe(channel, "nope")) == grpc.StatusCode.NOT_FOUND
        assert await refused(subscribe(channel, "e1", metadata=())) == grpc.StatusCode.UNAUTHENTICATED
        first = subscribe(channel, "e1")
        assert (await first.read()).WhichOneof("body") == "hello"  # the one subscriber the cap allows
        assert await refused(subscribe(channel, "e1")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        served.refusing = True
        assert await refused(subscribe(channel, "e1")) == grpc.StatusCode.UNAVAILABLE


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
