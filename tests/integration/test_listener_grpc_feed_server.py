"""listener.grpc_feed in process (a gRPC server on loopback, real channels): ListBackends, a Subscribe's hello and
snapshot, the refusals (NOT_FOUND, UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the cap, UNAUTHENTICATED
without the token) and the setup errors that stop a start. Through the whole listener and the picker's consumer:
tests/integration/test_grpc_feed.py.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_grpc_feed.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from picker.shared.feed_records import GRPC_LIST_BACKENDS, GRPC_SUBSCRIBE
from picker.shared.kvfeed_pb import feed_pb2 as pb
from tests.support.listener_grpc_feed import Served

TOKEN = "s3cret-token"


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
