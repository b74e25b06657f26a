"""The ext_proc servicer over a real gRPC server in the test (``serve``, a fixture: ``await serve(app)`` gives a
stub) and the ProcessingRequests Envoy sends it: request headers, body, response headers; ``exchange`` runs
one request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.extproc.messages import FULL_DUPLEX, RESPONSE_NONE
from picker.runtime.app import PickerApp
from tests.support.builders import CHAT, processor_of


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    """``await serve(app)`` -> a stub of a real gRPC server running the app's ExternalProcessor (stopped after)."""
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def start(app: PickerApp) -> pb_grpc.ExternalProcessorStub:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(processor_of(app), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return pb_grpc.ExternalProcessorStub(channel)

    try:
        yield start
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(grace=None)


def request_headers(
    path: str = CHAT, method: str = "POST", eos: bool = False, body_mode: int = FULL_DUPLEX
) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    for k, v in ((":path", path), (":method", method)):
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    msg.request_headers.end_of_stream = eos
    msg.protocol_config.request_body_mode = body_mode  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = RESPONSE_NONE  # type: ignore[assignment]
    return msg


def request_body(body: bytes) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = body
    msg.request_body.end_of_stream = True
    return msg


def response_headers(status: int = 200) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    return msg


async def exchange(
    stub: pb_grpc.ExternalProcessorStub, *messages: pb.ProcessingRequest, answers_before_response: int = 1
) -> list[pb.ProcessingResponse]:
    """One stream: the request messages, ``answers_before_response`` answers read, then (when routed) the response
    headers and trailers as Envoy sends them; the stream is half-closed and read to its end."""
    call = stub.Process()
    out: list[pb.ProcessingResponse] = []
    for m in messages:
        await call.write(m)
    for _ in range(answers_before_response):
        out.append(await call.read())
    if not any(r.HasField("immediate_response") for r in out):
        await call.write(response_headers())
        out.append(await call.read())
        trailers = pb.ProcessingRequest()
        trailers.response_trailers.SetInParent()
        await call.write(trailers)
        out.append(await call.read())
    await call.done_writing()
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    assert await call.code() == grpc.StatusCode.OK
    return out
