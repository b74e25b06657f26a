"""The gRPC servicer: one ``RequestStream`` per ``Process()`` call; the protocol lives in ``stream``.

It also admits streams: during a drain the lifecycle turns ``admitting`` off, new streams are
refused with UNAVAILABLE and ``wait_idle()`` tells when the open ones have finished. A peer (an IP address)
with ``extproc.max_streams_per_peer`` streams open has its next one refused with RESOURCE_EXHAUSTED, before
admission and before any ``RequestStream`` exists: it holds no lease and no admission slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.config import ExtProcConfig
from picker.extproc.sampling import ResponseSampling
from picker.extproc.stream import RESPONSE_PHASES, RequestStream, error_body, immediate, with_bypass
from picker.ops.metrics import PickerMetrics, RouteSeconds
from picker.request.path import RequestPath

log = logging.getLogger("kv_epp.extproc")


def peer_key(peer: str | None) -> str:
    """The peer address a stream counts against: gRPC's ``ipv4:10.0.0.5:41234`` / ``ipv6:[::1]:41234`` without
    the port (one Envoy opens several connections); anything else (``unix:...``) as given."""
    if not peer:
        return "unknown"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, sep, port = rest.rpartition(":")
        if sep and port.isdigit():
            return f"{kind}:{host}"
    return peer


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The gRPC service: one RequestStream per Process() call. Its collaborators: the request path, the metrics,
    the ``extproc`` settings (restart-required: read once) and the response sampling."""

    def __init__(
        self, path: RequestPath, metrics: PickerMetrics, extproc: ExtProcConfig, sampling: ResponseSampling | None
    ) -> None:
        self.path = path
        self.metrics = metrics
        # extproc is restart-required: a reloaded cap is reported as such, not applied
        self.max_per_peer = extproc.max_streams_per_peer
        self.per_peer: dict[str, int] = {}  # open streams by peer address; a peer with none has no entry
        self.peer_refused = 0  # streams refused over the per-peer cap (logged at stop)
        self.sampling = sampling
        self.route_seconds: RouteSeconds = metrics.route_seconds
        self.admitting = True  # turned off by the lifecycle once the drain's propagation delay is over
        self.refused = 0  # streams refused while draining (logged at stop)
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open_streams(self) -> int:
        return self._open

    async def wait_idle(self) -> None:
        """Return once no stream is open."""
        await self._idle.wait()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        if not self.admitting:
            self.refused += 1
            self.path.recorder.refused("draining")
            # UNAVAILABLE, not an ImmediateResponse 503: a 503 is a final answer Envoy relays to the client,
            # while UNAVAILABLE is a processor failure Envoy can fail over on (failure_mode_allow continues
            # without the picker, outlier detection ejects this host, status_on_error picks the client status).
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv-epp is draining: stream refused")
        peer = peer_key(context.peer())
        held = self.per_peer.get(peer, 0)
        if self.max_per_peer and held >= self.max_per_peer:
            self.peer_refused += 1
            self.metrics.child(self.metrics.extproc_refused_streams, "peer_limit").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"kv-epp: {held} ext_proc streams open from this peer (extproc.max_streams_per_peer): stream refused",
            )
        self.per_peer[peer] = held + 1
        try:
            admission = self.path.admission
            if not admission.open_stream():  # over admission.max_open_streams: 429 at the first message
                answer = self.path.overloaded(f"{admission.cfg.max_open_streams} requests are open")
                async for _ in request_iterator:  # an ImmediateResponse must answer a message of Envoy's
                    received = time.monotonic()
                    headers = with_bypass(self.path.cache, answer.headers)
                    try:
                        yield immediate(answer.status, answer.body, answer.details, headers)
                    finally:  # also when gRPC closes this generator at the yield (Envoy ended the stream)
                        self.route_seconds.observe("overloaded", time.monotonic() - received)
                    return
                return
            stream = RequestStream(self.path, self.route_seconds, self.sampling)
            self._open += 1
            self._idle.clear()
            try:
                async for req in request_iterator:
                    try:
                        phase = req.WhichOneof("request")
                        if phase in RESPONSE_PHASES:
                            responses = stream.respond(req, phase)
                        else:
                            responses = await stream.request(req, phase)
                    except Exception:  # a bug must cost one request, never the process
                        log.exception("event=extproc_error path=%r", stream.path)  # client text: escaped
                        self.path.recorder.refused("error")
                        stream.answer = "error"  # counted unless the routing answer was sent already
                        try:
                            yield immediate(
                                500, error_body("internal picker error", "picker_error", "api_error"), "kv_epp_error"
                            )
                        finally:
                            stream.answer_sent()
                        return
                    for r in responses:
                        # The sample is taken once gRPC has the answer: after the yield, or when gRPC closes this
                        # generator at the yield. Envoy ends the stream at an ImmediateResponse, and gRPC may
                        # close the generator before resuming it: a sample taken only after the yield was lost.
                        try:
                            yield r
                        finally:
                            if stream.answer is not None:  # the routing answer (always the first of its batch)
                                stream.answer_sent()
                    if stream.answered_itself:
                        return  # immediate response sent: nothing more to process
            finally:
                stream.close()
                admission.close_stream()
                self._open -= 1
                if self._open == 0:
                    self._idle.set()
        finally:
            left = self.per_peer[peer] - 1
            if left:
                self.per_peer[peer] = left
            else:
                del self.per_peer[peer]
