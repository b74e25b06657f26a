"""The floor for any Python picker: an ext_proc server that does the protocol and nothing else.

Same grpc.aio stack as the picker and the same message pattern (full duplex: buffer the body, send
the deferred headers response with a fixed destination and Content-Length, echo the body in
62,000-byte chunks, echo response chunks; buffered: answer headers, then the body with the header),
but no parsing, no keys, no decision: the destination rotates over a fixed list.

Run: python -m benchmarks.noop_extproc [--port P] --dest 127.0.0.1:8001[,127.0.0.2:8001...] [--processing-mode JSON]

``--processing-mode`` is the ext_proc filter's ``processing_mode`` as the generated bootstrap has it (the
harness reads it from the picker's bootstrap): its body modes are the floor's defaults, which Envoy's
``protocol_config`` (first message of a stream) overrides when Envoy sends it. The header and trailer
modes need nothing here: the floor answers whatever phase arrives.

Once it listens it prints ``noop-extproc ready extproc=127.0.0.1:PORT`` on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.api import GRPC_OPTIONS, pick_response, streamed_chunks

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode


def body_modes(processing_mode: dict[str, Any] | None) -> tuple[int, int]:
    """(request, response) body modes of a bootstrap's ``processing_mode`` (missing: NONE, Envoy's default)."""
    pm = processing_mode or {}
    return (
        BodySendMode.Value(pm.get("request_body_mode", "NONE")),
        BodySendMode.Value(pm.get("response_body_mode", "NONE")),
    )


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, destinations: list[str], modes: tuple[int, int] = (FULL_DUPLEX, FULL_DUPLEX)) -> None:
        self._dest = itertools.cycle(destinations)
        self._modes = modes

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        mode, resp_mode = self._modes
        chunks: list[bytes] = []
        async for req in request_iterator:
            if req.HasField("protocol_config"):
                mode, resp_mode = req.protocol_config.request_body_mode, req.protocol_config.response_body_mode
            phase = req.WhichOneof("request")
            if phase == "request_headers":
                if req.request_headers.end_of_stream:
                    yield self._route(0, at_headers=True, buffered=mode != FULL_DUPLEX)
                elif mode != FULL_DUPLEX:  # buffered: headers answered now, the pick rides on the body answer
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif phase == "request_body":
                chunks.append(req.request_body.body)
                if req.request_body.end_of_stream:
                    body = b"".join(chunks)
                    if mode == FULL_DUPLEX:
                        yield self._route(len(body), at_headers=True, buffered=False)
                        for r in streamed_chunks(body, True, request=True):
                            yield r
                    else:
                        yield self._route(len(body), at_headers=False, buffered=True)
            elif phase == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif phase == "response_body":
                if resp_mode == FULL_DUPLEX:
                    for r in streamed_chunks(req.response_body.body, req.response_body.end_of_stream, request=False):
                        yield r
                else:
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif phase == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif phase == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def _route(self, body_len: int, *, at_headers: bool, buffered: bool) -> pb.ProcessingResponse:
        content_length = body_len if not buffered and body_len else None
        return pick_response(next(self._dest), content_length, on_body=buffered and not at_headers)


READY_PREFIX = "noop-extproc ready"


async def serve(port: int, destinations: list[str], processing_mode: dict[str, Any] | None = None) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    modes = body_modes(processing_mode) if processing_mode is not None else (FULL_DUPLEX, FULL_DUPLEX)
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(destinations, modes), server)
    health_servicer = health.aio.HealthServicer()  # Envoy health-checks it, as it does the picker
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("kv-epp.accepting", health_pb2.HealthCheckResponse.SERVING)
    # The harness waits for this line (with the bound port, so --port 0 works) before sending traffic.
    print(f"{READY_PREFIX} extproc=127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0, help="0 (the default): any free port, reported on the ready line")
    p.add_argument("--dest", required=True, help="comma-separated ip:port list")
    p.add_argument("--processing-mode", default=None, help="the bootstrap's ext_proc processing_mode, as JSON")
    a = p.parse_args()
    pm = json.loads(a.processing_mode) if a.processing_mode else None
    asyncio.run(serve(a.port, a.dest.split(","), pm))


if __name__ == "__main__":
    main()
