"""The conformance kit's own checks can fail: against in-process ext_proc servers, each with one flaw of the GIE
protocol, the case that checks it FAILs and the others pass; a hung server fails its cases by the per-case timeout
instead of hanging the kit; an unreachable one fails ``connect`` and skips the rest; bad flags are one ``error:``
line and exit 2. The kit against real pickers: tests/integration/test_conformance_kit.py."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.conformance import kit
from picker.conformance.options import parse_endpoint
from picker.conformance.wire import DEST_HEADER, FULL_DUPLEX, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from picker.runtime import cli

POOL = ["10.0.0.1:8000", "10.0.0.2:8000"]


class FlawedPicker(pb_grpc.ExternalProcessorServicer):
    """A GIE picker in a few lines (full duplex and buffered, subset hint, 400 on a body that is not JSON with a
    ``model``) with
    one ``flaw``: none, mismatch (metadata names another endpoint), chunks (answers each body chunk), echo (drops
    the body's last byte), hang (never answers)."""

    def __init__(self, flaw: str) -> None:
        self.flaw = flaw

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest], context: Any) -> AsyncIterator[Any]:
        mode, body, subset = FULL_DUPLEX, b"", None
        async for req in requests:
            if self.flaw == "hang":
                continue
            if req.HasField("protocol_config"):
                mode = req.protocol_config.request_body_mode
            fm = req.metadata_context.filter_metadata
            if SUBSET_NAMESPACE in fm:
                subset = [v.string_value for v in fm[SUBSET_NAMESPACE].fields[SUBSET_KEY].list_value.values]
            phase = req.WhichOneof("request")
            if phase == "request_headers":
                if req.request_headers.end_of_stream:
                    yield self.pick(subset, b"", on_body=False)
                elif mode != FULL_DUPLEX:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif phase == "request_body":
                body += req.request_body.body
                if not req.request_body.end_of_stream:
                    if self.flaw == "chunks":
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                    continue
                if not has_model(body):
                    r = pb.ProcessingResponse()
                    r.immediate_response.status.code = 400
                    r.immediate_response.body = b'{"error": "bad body"}'
                    yield r
                    return
                yield self.pick(subset, body, on_body=mode != FULL_DUPLEX)
                if mode == FULL_DUPLEX:
                    echo = body[:-1] if self.flaw == "echo" else body
                    r = pb.ProcessingResponse()
                    r.request_body.response.body_mutation.streamed_response.body = echo
                    r.request_body.response.body_mutation.streamed_response.end_of_stream = True
                    yield r
            elif phase == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif phase == "response_body":
                r = pb.ProcessingResponse()
                r.response_body.response.body_mutation.streamed_response.body = req.response_body.body
                r.response_body.response.body_mutation.streamed_response.end_of_stream = req.response_body.end_of_stream
                yield r

    def pick(self, subset: list[str] | None, body: bytes, *, on_body: bool) -> pb.ProcessingResponse:
        if subset is not None and not any(e in POOL for e in subset):
            r = pb.ProcessingResponse()
            r.immediate_response.status.code = 503
            return r
        dest = next(e for e in POOL if subset is None or e in subset)
        r = pb.ProcessingResponse()
        common = r.request_body.response if on_body else r.request_headers.response
        opt = common.header_mutation.set_headers.add()
        opt.header.key, opt.header.raw_value = DEST_HEADER, dest.encode()
        meta = POOL[1] if self.flaw == "mismatch" and dest == POOL[0] else dest
        r.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DEST_HEADER].string_value = meta
        return r


def has_model(body: bytes) -> bool:
    try:
        return "model" in json.loads(body)
    except ValueError:
        return False


@contextlib.asynccontextmanager
async def serving(flaw: str) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FlawedPicker(flaw), server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await h.set(svc, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def statuses(target: str, *flags: str) -> dict[str, str]:
    """Each case's status; its detail after a FAIL (the assertion messages show why)."""
    opts = kit.options(kit.parse(["--target", target, "--endpoints", ",".join(POOL), *flags]))
    return {r.name: r.status if r.status != "FAIL" else f"FAIL {r.detail}" for r in await kit.run(opts, emit=False)}


async def test_a_picker_that_follows_the_protocol_passes_every_case() -> None:
    async with serving("none") as target:
        got = await statuses(target)
    assert set(got.values()) == {"PASS"}, got
    assert {"full_duplex/destination", "buffered/destination", "health", "pool"} <= set(got)


ROUTED = {"destination", "body", "fallbacks", "subset", "header_only", "served", "malformed", "aborted"}


async def test_without_endpoints_the_pool_is_learned_from_the_answers() -> None:
    async with serving("none") as target:
        results = await kit.run(kit.options(kit.parse(["--target", target, "--body-mode", "buffered"])), emit=False)
    by_name = {r.name: r for r in results}
    assert {r.status for r in results} == {"PASS"}, results
    assert by_name["pool"].detail.startswith(f"1 endpoint named in 8 answers: {POOL[0]}")  # the fake picks the first
    assert "membership is not checked" in by_name["pool"].detail
    assert "well formed" in by_name["buffered/destination"].detail


@pytest.mark.parametrize(
    ("flaw", "failing", "says"),
    [
        ("mismatch", ROUTED, "and envoy.lb metadata '10.0.0.2:8000' differ"),
        ("chunks", {"body"}, "a body chunk answered before the request headers (Envoy: 'spurious message')"),
        ("echo", {"body"}, "the body came back changed"),
    ],
)
async def test_each_flaw_fails_the_case_that_checks_it(flaw: str, failing: set[str], says: str) -> None:
    async with serving(flaw) as target:
        got = await statuses(target, "--body-mode", "full_duplex")
    failed = {name.removeprefix("full_duplex/"): status for name, status in got.items() if status.startswith("FAIL")}
    assert set(failed) == failing, got
    assert all(says in status for status in failed.values()), failed


async def test_a_hung_picker_fails_its_cases_by_the_timeout() -> None:
    async with serving("hang") as target:
        opts = kit.options(kit.parse(["--target", target, "--endpoints", POOL[0], "--body-mode", "buffered",
                                      "--case-timeout", "0.3"]))  # fmt: skip
        results = await kit.run(opts, emit=False)
    by_name = {r.name: r for r in results}
    assert by_name["connect"].status == "PASS"  # connecting is not a case: it waits at least CONNECT_TIMEOUT_FLOOR_S
    assert by_name["buffered/destination"].status == "FAIL"
    assert by_name["buffered/destination"].detail == "no answer within 0.3 s"
    assert all(r.status == "FAIL" for r in results if r.name.startswith("buffered/"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_picker_fails_connect_and_skips_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["conformance", "--target", f"127.0.0.1:{free_port()}", "--case-timeout", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert lines[0].startswith("FAIL connect — no gRPC connection within 5 s")
    assert all(line.startswith("SKIP ") for line in lines[1:-1]) and len(lines) == 22  # 20 cases, the summary
    assert lines[-1].startswith("summary: 0 PASS, 1 FAIL, 20 SKIP")


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--target", "nohost"], "--target 'nohost': expected HOST:PORT"),
        (["--target", "h:1", "--endpoints", "10.0.0.1:80,pod-a:80"], "--endpoints: pod-a:80: expected ip:port"),
        (["--target", "h:1", "--ca", "/dev/null", "--insecure"], "--ca and --insecure exclude each other"),
        (["--target", "h:1", "--token-file", "/nonexistent/token"], "--token-file /nonexistent/token:"),
        (["--target", "h:1", "--case-timeout", "0"], "--case-timeout must be positive"),
    ],
)
def test_bad_flags_are_one_error_line_and_exit_2(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["conformance", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {error}"), err


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("10.0.0.1:8000", "10.0.0.1:8000"), ("[::1]:80", "[::1]:80"), (" 10.0.0.1:08 ", "10.0.0.1:8"),
     ("pod:80", None), ("10.0.0.1", None), ("10.0.0.1:0", None), ("10.0.0.1:70000", None)],
)  # fmt: skip
def test_parse_endpoint(value: str, parsed: str | None) -> None:
    assert parse_endpoint(value) == parsed
