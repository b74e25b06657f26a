"""The gRPC servicer: one ``RequestStream`` per ``Process()`` call; the protocol lives in ``stream``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.extproc.stream import RequestStream, error_body, immediate

if TYPE_CHECKING:
    from picker.runtime.app import PickerApp

log = logging.getLogger("kv_epp.extproc")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The gRPC service: one RequestStream per Process() call."""

    def __init__(self, app: PickerApp) -> None:
        self.app = app

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = RequestStream(self.app)
        self.app.open_streams += 1
        try:
            async for req in request_iterator:
                try:
                    responses = await stream.handle(req)
                except Exception:  # a bug must cost one request, never the process
                    log.exception("event=extproc_error path=%s", stream.path)
                    self.app.metrics.requests.labels("error").inc()
                    yield immediate(
                        500, error_body("internal picker error", "picker_error", "api_error"), "kv_epp_error"
                    )
                    return
                for r in responses:
                    yield r
                if stream.done and stream.decision is None:
                    return  # immediate response sent: nothing more to process
        finally:
            stream.close()
            self.app.open_streams -= 1
