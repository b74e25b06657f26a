"""The kit's cases: each drives the picker as a GIE gateway would and checks what GIE's endpoint-picker protocol
(v1.0.0) requires; what the protocol leaves optional is a note, never a failure. One case = one line of the report.
See docs/conformance.md for each case, what the protocol says and what is checked.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.conformance.options import parse_endpoint
from picker.conformance.wire import (
    DEST_HEADER,
    FULL_DUPLEX,
    RESPONSE_NONE,
    SERVED_KEY,
    Immediate,
    Picked,
    ProtocolError,
    Stream,
    request_body,
    request_headers,
    send_request,
    send_response,
)

# GIE v1.0.0 names these health services ("The EPP exposes ..."): SERVING is required of each.
REQUIRED_HEALTH = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
# Probed by others, not named by the protocol: informational ("" = the server's overall health; the GIE
# conformance manifests and the llm-d chart probe "inference-extension").
OPTIONAL_HEALTH = ("", "inference-extension")
UNKNOWN_ENDPOINT = "192.0.2.1:9"  # TEST-NET-1 (RFC 5737): in no real pool; also the spoofed client header
LEARN_REQUESTS = 8  # requests sent to learn the pool from the answers when --endpoints is not given
LARGE_BODY_BYTES = 150_000  # over two of Envoy's 62,000-byte streamed mutations: the echo must reassemble it
ABORTS_MID_BODY = 10
ABORTS_AFTER_PICK = 5


class Failed(Exception):
    """A required check failed: the message is the report's detail."""


class Skipped(Exception):
    """The case cannot run against this picker (e.g. a pool of one endpoint for a two-endpoint check)."""


def require(cond: object, detail: str) -> None:
    if not cond:
        raise Failed(detail)


@dataclass(slots=True)
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name} — {self.detail}"


@dataclass
class Context:
    """What every case shares: the picker's stubs, the call metadata (a bearer token), the pool, the bounds."""

    stub: pb_grpc.ExternalProcessorStub
    health: health_pb2_grpc.HealthStub
    metadata: Sequence[tuple[str, str]]
    model: str
    timeout: float  # per case, and the gRPC deadline of each of its streams
    pool: list[str] = field(default_factory=list)
    pool_given: bool = False
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _run: str = field(default_factory=lambda: secrets.token_hex(4))

    def stream(self) -> Stream:
        return Stream(self.stub, self.metadata, self.timeout)

    def chat(self, tag: str, pad: int = 0, model: str | None = None) -> bytes:
        """A chat request with a prompt seen once (no response cache can answer it), ``pad`` bytes longer."""
        text = f"conformance {self._run} {tag} #{next(self._seq)} " + "x" * pad
        return json.dumps({"model": model or self.model, "messages": [{"role": "user", "content": text}]}).encode()

    def check_pick(self, p: Picked, subset: Sequence[str] | None = None) -> list[str]:
        """The GIE rules of a pick (header AND envoy.lb metadata, equal, ip:port, distinct, in the pool and in the
        subset); Failed on the first broken one. Returns the ranked list."""
        require(p.header is not None, f"no {DEST_HEADER} header with the pick (envoy.lb has {p.metadata!r})")
        require(p.metadata is not None, f"no envoy.lb {DEST_HEADER} metadata with the pick (header {p.header!r})")
        require(p.header == p.metadata, f"header {p.header!r} and envoy.lb metadata {p.metadata!r} differ")
        listed = p.endpoints
        require(listed, f"an empty {DEST_HEADER}")
        for e in listed:
            require(parse_endpoint(e) is not None, f"{e!r} in {p.header!r} is not an ip:port")
        require(len(set(listed)) == len(listed), f"an endpoint listed twice in {p.header!r}")
        require(listed[0] != UNKNOWN_ENDPOINT, f"the client's spoofed {DEST_HEADER} {UNKNOWN_ENDPOINT} was kept")
        if self.pool_given:
            outside = [e for e in listed if parse_endpoint(e) not in self.pool]
            require(not outside, f"{', '.join(outside)} not in the pool ({DEST_HEADER}: {p.header})")
        if subset is not None:
            outside = [e for e in listed if parse_endpoint(e) not in subset]
            require(not outside, f"{', '.join(outside)} outside the subset hint {list(subset)}")
        return listed

    async def exchange(
        self, mode: int, body: bytes | None, *, served: str | None = None, **kw: Any
    ) -> tuple[Picked | Immediate, list[str]]:
        """One whole request: routing, then (when routed) the upstream's response reported served by ``served``
        (default: the pick), as the gateway does. Returns the routing answer and the response's notes."""
        response_mode = FULL_DUPLEX if mode == FULL_DUPLEX else RESPONSE_NONE
        s = self.stream()
        try:
            answer = await send_request(s, mode, response_mode, body, **kw)
            if isinstance(answer, Immediate):
                return answer, []
            listed = answer.endpoints
            reported = served or (listed[0] if listed else answer.metadata)
            notes = await send_response(s, response_mode, reported, b'{"id":"conformance","choices":[]}')
            return answer, notes
        finally:
            s.cancel()  # after an ImmediateResponse the gateway drops the stream; a no-op on a finished one

    async def routed(self, mode: int, body: bytes | None, **kw: Any) -> Picked:
        """A request that must be routed (Failed on an ImmediateResponse)."""
        answer, _ = await self.exchange(mode, body, **kw)
        if isinstance(answer, Immediate):
            raise Failed(f"answered itself with {answer.status} ({answer.body[:120]!r}) instead of a pick")
        return answer


Case = Callable[[Context, list[str]], Awaitable[str]]


async def run_case(ctx: Context, name: str, case: Case) -> Result:
    """Run one case under the per-case timeout: a hung picker fails the case, it never hangs the kit."""
    notes: list[str] = []
    try:
        detail = await asyncio.wait_for(case(ctx, notes), ctx.timeout)
        status = "PASS"
    except Failed as exc:
        status, detail = "FAIL", str(exc)
    except ProtocolError as exc:
        status, detail = "FAIL", str(exc)
    except Skipped as exc:
        status, detail = "SKIP", str(exc)
    except TimeoutError:
        status, detail = "FAIL", f"no answer within {ctx.timeout:g} s"
    except grpc.aio.AioRpcError as exc:
        status, detail = "FAIL", f"gRPC {exc.code().name}: {exc.details()}"
    except Exception as exc:  # an answer the kit did not foresee fails that case, never the kit
        status, detail = "FAIL", f"unexpected {type(exc).__name__}: {exc}"
    if notes:
        detail += "; note: " + "; ".join(notes)
    return Result(name, status, detail)


# -- cases that run once ----------------------------------------------------------------------------------------
async def learn_pool(ctx: Context, notes: list[str], mode: int) -> str:
    """The pool: given (``--endpoints``), or learned from the endpoints the picker names in its answers."""
    if ctx.pool_given:
        return f"{len(ctx.pool)} endpoints given: {', '.join(ctx.pool)}"
    seen: dict[str, None] = {}
    for i in range(LEARN_REQUESTS):
        p = await ctx.routed(mode, ctx.chat(f"learn-{i}"))
        for e in ctx.check_pick(p):
            seen[parse_endpoint(e) or e] = None
    ctx.pool = list(seen)
    notes.append("pool learned from the answers: membership is not checked (give --endpoints to check it)")
    n = len(ctx.pool)
    return f"{n} endpoint{'s' if n != 1 else ''} named in {LEARN_REQUESTS} answers: {', '.join(ctx.pool)}"


async def health(ctx: Context, notes: list[str]) -> str:
    """grpc.health.v1 Health/Check: the services GIE names SERVING; the others reported."""

    async def check(service: str) -> str:
        try:
            r = await ctx.health.Check(
                health_pb2.HealthCheckRequest(service=service), metadata=tuple(ctx.metadata), timeout=ctx.timeout
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    bad = []
    for service in REQUIRED_HEALTH:
        status = await check(service)
        if status != "SERVING":
            bad.append(f"{service}: {status}")
    for service in OPTIONAL_HEALTH:
        status = await check(service)
        if status != "SERVING":
            notes.append(f"{service or 'overall'}: {status}")
    require(not bad, "not SERVING: " + ", ".join(bad))
    return f"{', '.join(REQUIRED_HEALTH)}: SERVING"


async def connect(channel: grpc.aio.Channel, timeout: float) -> Result:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except TimeoutError:
        return Result("connect", "FAIL", f"no gRPC connection within {timeout:g} s (address, TLS or certificate?)")
    return Result("connect", "PASS", "gRPC channel ready")


# -- cases per body mode ----------------------------------------------------------------------------------------
def mode_cases(mode: int) -> list[tuple[str, Case]]:
    """The cases run in each body mode the kit is asked for, in order (the aborts last)."""

    async def destination(ctx: Context, notes: list[str]) -> str:
        seen: dict[str, None] = {}
        for i in range(4):  # a client-supplied destination rides along: it must not decide
            p = await ctx.routed(mode, ctx.chat(f"dest-{i}"), extra_headers=[(DEST_HEADER, UNKNOWN_ENDPOINT)])
            seen[ctx.check_pick(p)[0]] = None
        where = "in the pool" if ctx.pool_given else "well formed"
        return f"4 picks in header and envoy.lb, equal, {where}: {', '.join(seen)}"

    async def body(ctx: Context, notes: list[str]) -> str:
        payload = ctx.chat("body", pad=LARGE_BODY_BYTES)
        s = ctx.stream()
        response_mode = FULL_DUPLEX if mode == FULL_DUPLEX else RESPONSE_NONE
        try:
            answer = await send_request(s, mode, response_mode, payload, chunks=3)
            if isinstance(answer, Immediate):
                raise Failed(f"answered itself with {answer.status} ({answer.body[:120]!r})")
            ctx.check_pick(answer)
            await send_response(s, response_mode, answer.endpoints[0], b"{}")
        finally:
            s.cancel()
        if mode == FULL_DUPLEX:
            echoed = answer.echoed or b""
            require(echoed == payload, f"the body came back changed: {len(echoed)} of {len(payload)} bytes")
            if answer.content_length is None:
                notes.append("no content-length with the pick (Envoy then streams the body chunked)")
            else:
                require(
                    answer.content_length == str(len(payload)),
                    f"content-length {answer.content_length} for a {len(payload)}-byte body",
                )
            return f"{len(payload)} bytes in 3 chunks: headers answered at end_of_stream, body echoed byte-exact"
        if answer.phase == "request_headers":
            notes.append("picked at the headers, before the body arrived")
        return f"{len(payload)} bytes in one body message: the pick on the {answer.phase} answer"

    async def fallbacks(ctx: Context, notes: list[str]) -> str:
        longest: list[str] = []
        for i in range(4):
            listed = ctx.check_pick(await ctx.routed(mode, ctx.chat(f"fallback-{i}")))
            longest = max(longest, listed, key=len)
        if len(longest) == 1:
            notes.append("one endpoint per pick: no fallbacks offered (optional in GIE's protocol)")
            return "single-endpoint picks"
        return f"ranked lists of up to {len(longest)} distinct endpoints, e.g. {','.join(longest)}"

    async def subset(ctx: Context, notes: list[str]) -> str:
        pool = ctx.pool
        if not pool:
            raise Skipped("no endpoint known (the pool case failed)")
        hints = [[e] for e in pool[:3]] + ([pool[1:3]] if len(pool) >= 3 else [])
        for hint in hints:
            for i in range(2):
                p = await ctx.routed(mode, ctx.chat(f"subset-{i}"), subset=hint)
                listed = ctx.check_pick(p, subset=hint)
                require(listed[0] in hint, f"picked {listed[0]} outside the subset {hint}")
        if len(pool) == 1:
            notes.append("a pool of one: the subset was the whole pool")
        return f"{len(hints)} subset hints, every listed endpoint inside its hint"

    async def subset_empty(ctx: Context, notes: list[str]) -> str:
        for hint, what in (([], "an empty subset"), ([UNKNOWN_ENDPOINT], f"a subset of {UNKNOWN_ENDPOINT} only")):
            answer, _ = await ctx.exchange(mode, ctx.chat("subset-empty"), subset=hint)
            if isinstance(answer, Picked):
                raise Failed(f"{what}: routed to {answer.header} (an ImmediateResponse 503 is required)")
            require(answer.status == 503, f"{what}: ImmediateResponse {answer.status} (503 required)")
        return "an empty subset and an unknown one: ImmediateResponse 503"

    async def header_only(ctx: Context, notes: list[str]) -> str:
        answer, _ = await ctx.exchange(mode, None, method="GET", path="/v1/models")
        if isinstance(answer, Immediate):  # a picker may answer a non-inference path itself, but not fail it
            require(answer.status < 500, f"GET /v1/models: ImmediateResponse {answer.status} (a pool that serves?)")
            notes.append(f"answered itself with {answer.status}")
            return "GET /v1/models (end_of_stream on the headers): answered"
        listed = ctx.check_pick(answer)  # a request without a body can only be picked on its headers' answer
        return f"GET /v1/models (end_of_stream on the headers): picked {listed[0]} on the headers answer"

    async def served(ctx: Context, notes: list[str]) -> str:
        first = await ctx.routed(mode, ctx.chat("served-pick"), served=UNKNOWN_ENDPOINT)
        ctx.check_pick(first)
        p = await ctx.routed(mode, ctx.chat("served"))
        listed = ctx.check_pick(p)
        reported = listed[1] if len(listed) > 1 else listed[0]
        answer, response_notes = await ctx.exchange(mode, ctx.chat("served-fallback"), served=reported)
        notes.extend(response_notes)
        if isinstance(answer, Picked):
            ctx.check_pick(answer)
        what = "a fallback" if len(listed) > 1 else "the pick"
        echo = ", response body echoed as streamed mutations" if mode == FULL_DUPLEX else ""
        return f"{SERVED_KEY} = {what} (and once an unknown endpoint): the response headers continued{echo}"

    async def malformed(ctx: Context, notes: list[str]) -> str:
        bodies = (
            (b"this is not json {", "non-JSON"),
            (json.dumps({"messages": [{"role": "user", "content": "no model"}]}).encode(), "JSON without model"),
            (ctx.chat("truncated")[:-9], "truncated JSON"),
        )
        statuses = []
        for payload, what in bodies:
            answer, _ = await ctx.exchange(mode, payload)
            if isinstance(answer, Picked):
                raise Failed(f"{what} body routed to {answer.header} (an ImmediateResponse 4xx is required)")
            require(400 <= answer.status < 500, f"{what} body: ImmediateResponse {answer.status} (4xx required)")
            if answer.json_body() is None:
                notes.append(f"{what}: the {answer.status} body is not JSON")
            statuses.append(str(answer.status))
        ctx.check_pick(await ctx.routed(mode, ctx.chat("after-malformed")))
        return f"non-JSON, no model, truncated: {'/'.join(statuses)}; the next request picked"

    async def aborted(ctx: Context, notes: list[str]) -> str:
        response_mode = FULL_DUPLEX if mode == FULL_DUPLEX else RESPONSE_NONE
        for i in range(ABORTS_MID_BODY):  # the client goes away mid-body: the gateway cancels the stream
            s = ctx.stream()
            payload = ctx.chat(f"abort-{i}", pad=1000)
            await s.send(request_headers(mode, response_mode, "POST", "/v1/chat/completions"))
            if mode == FULL_DUPLEX:
                await s.send(request_body(payload[:500], False))
            else:
                await s.recv("the answer to the request headers")
            s.cancel()
        for i in range(ABORTS_AFTER_PICK):  # routed, then cancelled before any response
            s = ctx.stream()
            answer = await send_request(s, mode, response_mode, ctx.chat(f"abort-picked-{i}"))
            s.cancel()
            if isinstance(answer, Picked):
                ctx.check_pick(answer)
        ctx.check_pick(await ctx.routed(mode, ctx.chat("after-aborts")))
        return (
            f"{ABORTS_MID_BODY} streams cancelled mid-body, {ABORTS_AFTER_PICK} after the pick; the next request picked"
        )

    return [
        ("destination", destination),
        ("body", body),
        ("fallbacks", fallbacks),
        ("subset", subset),
        ("subset_empty", subset_empty),
        ("header_only", header_only),
        ("served", served),
        ("malformed", malformed),
        ("aborted", aborted),
    ]
