"""The sidecar's HTTP handling (aiohttp, server and client): a request without ``x-prefiller-host-port`` is relayed
to the local engine as it came (minus hop-by-hop headers and that header); a P/D request is checked (the header's
``ip:port``, the SSRF allowlist, the body) and run as the connector's two legs. Every upstream request is tied to
its client's: a client that goes away cancels it (the engine sees its connection close). See docs/pd.md, "The
routing sidecar".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from picker.pdsidecar.allowlist import Allowlist, Verdict
from picker.pdsidecar.connectors import (
    BadPrefillAnswer,
    Connector,
    Target,
    cached_tokens,
    parse_object,
    rewrite_cached_tokens,
)
from picker.pdsidecar.metrics import SidecarMetrics
from picker.pdsidecar.options import SidecarOptions
from picker.shared.discovery.config import canonical_ip_port

log = logging.getLogger("kv_epp.pd_sidecar")

PREFILL_HEADER = "x-prefiller-host-port"
STATE_HEADER = "x-kv-epp-prefill"  # on P/D answers only: remote | local-fallback | failed
REQUEST_ID = "x-request-id"
PD_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
# RFC 9110 7.6.1 connection-specific fields (and those a Connection header names) are not forwarded; nor is Expect
# (this hop answers it) or our own header.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "expect", PREFILL_HEADER}
)  # fmt: skip
MAX_PREFILL_ANSWER_BYTES = 16 << 20  # a prefill answer is one token; a larger one is a bad answer
MAX_ERROR_BODY_BYTES = 1 << 20  # the part of an engine's error answer kept and passed on
MAX_REWRITE_BYTES = 16 << 20  # a decode answer buffered to rewrite cached_tokens; a longer one passes untouched
# The 4xx a local prefill would repeat (the request's own fault) are the client's even with --prefill-failure local.
FALLBACK_4XX = frozenset({408, 429})


def forwarded(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """``headers`` minus hop-by-hop ones (those a Connection header names too), ``x-prefiller-host-port`` and
    ``drop`` (lower case); repeated headers are kept, in order."""
    named = {t.strip().lower() for v in headers.getall("connection", ()) for t in v.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in HOP_BY_HOP and lk not in named and lk not in drop:
            out.add(k, v)
    return out


def prefill_target(values: list[str]) -> str | None:
    """The prefill endpoint a request names: the first non-empty item of its ``x-prefiller-host-port`` values
    (repeated headers and comma lists alike); None when it names none."""
    for value in values:
        for item in value.split(","):
            if item.strip():
                return item.strip()
    return None


def error_response(status: int, message: str, code: str, kind: str, state: str | None = None) -> web.Response:
    """A JSON error the sidecar gives itself (OpenAI's error shape, as the picker's)."""
    body = orjson.dumps({"error": {"message": message, "type": kind, "code": code}})
    headers = {STATE_HEADER: state} if state else None
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


async def read_up_to(stream: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of ``stream`` (one chunk more, at most, is read); True when it ended within them."""
    parts: list[bytes] = []
    size = 0
    async for chunk in stream.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(parts), False
    return b"".join(parts), True


@dataclass(eq=False)
class PrefillFailure(Exception):
    """A failed prefill leg: ``kind`` (the metric's label), the status the client gets, and for an HTTP error the
    engine's answer (passed on when it is JSON)."""

    kind: str  # http_error | connect_error | timeout | bad_answer
    status: int
    message: str
    body: bytes = b""
    json_body: bool = False

    def __str__(self) -> str:
        return self.message

    @property
    def may_fall_back(self) -> bool:
        """Whether ``--prefill-failure local`` decodes locally: not for a 4xx a local prefill would repeat."""
        return not (self.kind == "http_error" and 400 <= self.status < 500 and self.status not in FALLBACK_4XX)

    def response(self, target: str) -> web.Response:
        if self.kind == "http_error" and self.json_body:
            return web.Response(
                status=self.status, body=self.body, content_type="application/json", headers={STATE_HEADER: "failed"}
            )
        return error_response(
            self.status, f"the prefill leg to {target} failed: {self.message}", self.kind, "prefill_failed", "failed"
        )


class EngineError(Exception):
    """The local engine could not be reached (no answer's headers)."""

    def __init__(self, kind: str, status: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    def response(self, state: str | None) -> web.Response:
        return error_response(self.status, str(self), self.kind, "local_engine_unavailable", state)


@dataclass(slots=True)
class _Progress:
    """Where one request is, for the client-abort counter: the leg then running."""

    leg: str


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Sidecar:
    """The handler of every request, with the one HTTP client session for both engines (its connections pooled
    and kept alive; their number is bounded by the in-flight bounds: a request holds at most two)."""

    def __init__(
        self, opts: SidecarOptions, connector: Connector, allowlist: Allowlist, metrics: SidecarMetrics
    ) -> None:
        self.opts = opts
        self.connector = connector
        self.allowlist = allowlist
        self.metrics = metrics
        scheme = "https" if opts.decoder_use_tls else "http"
        self.engine = f"{scheme}://{_host_port(opts.model_server_host, opts.model_server_port)}"
        self._prefill_scheme = "https" if opts.prefiller_use_tls else "http"
        self._prefill_ssl: bool | ssl.SSLContext = not opts.prefiller_tls_insecure_skip_verify
        self._engine_ssl: bool | ssl.SSLContext = not opts.decoder_tls_insecure_skip_verify
        self._session: aiohttp.ClientSession | None = None
        self._inflight = 0
        self._pd_inflight = 0
        self._buffered = 0  # bytes of the P/D bodies in flight (--max-buffered-bytes)

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),  # bounded by the in-flight bounds
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.opts.connect_timeout, sock_connect=self.opts.connect_timeout
            ),
            auto_decompress=False,  # bytes as the engine sent them
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),  # headers as the client's
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Sidecar.open() first"
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.opts.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    # --- the request ---

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._inflight >= self.opts.max_requests:
            return self._reject(
                "overloaded", 503, f"the sidecar has {self._inflight} requests in flight (--max-requests)"
            )
        progress = _Progress("passthrough")
        self._inflight += 1
        self.metrics.inflight.labels("all").inc()
        try:
            target = prefill_target(request.headers.getall(PREFILL_HEADER, []))
            if target is None:
                self.metrics.passthrough.labels("no_header").inc()
                return await self._passthrough(request)
            if request.method != "POST" or request.path not in PD_ROUTES:
                self.metrics.passthrough.labels("not_pd_route").inc()
                log.info("event=prefill_header_ignored method=%s path=%r (no P/D on this route)", request.method,
                         request.path)  # fmt: skip
                return await self._passthrough(request)
            return await self._pd(request, target, progress)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.client_aborts.labels(progress.leg).inc()
            log.info("event=client_aborted leg=%s path=%r", progress.leg, request.path)
            raise
        finally:
            self._inflight -= 1
            self.metrics.inflight.labels("all").dec()

    def _reject(self, reason: str, status: int, message: str) -> web.Response:
        self.metrics.rejected.labels(reason).inc()
        log.warning("event=request_rejected reason=%s status=%d message=%r", reason, status, message)
        return error_response(status, message, reason, "invalid_request_error" if status < 500 else "unavailable")

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        data = request.content if request.body_exists else None
        return await self._relay(request, request.method, forwarded(request.headers), data, None, None)

    async def _pd(self, request: web.Request, raw_target: str, progress: _Progress) -> web.StreamResponse:
        try:
            target = Target(canonical_ip_port(raw_target))
        except ValueError as exc:
            return self._reject("bad_header", 400, f"{PREFILL_HEADER} {raw_target!r}: {exc}")
        verdict = self.allowlist.check(target.address)
        if verdict is Verdict.NOT_IN_POOL:
            self.metrics.ssrf_refusals.inc()
            log.warning("event=prefill_target_refused target=%s peer=%s allowlist=%r (not in the pool)",
                        target.address, request.remote, self.allowlist.source)  # fmt: skip
            return error_response(
                403, f"prefill target {target.address} is not an endpoint of the pool", "prefill_target_not_in_pool",
                "forbidden",
            )  # fmt: skip
        if verdict is Verdict.NOT_SYNCED:
            return self._reject(
                "allowlist_not_synced", 503, f"the pool ({self.allowlist.source}) is not known yet: no prefill target"
                " can be checked",
            )  # fmt: skip
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return self._reject(
                "unsupported_encoding", 415, f"a P/D request body must not be encoded (content-encoding {encoding!r})"
            )
        if self._pd_inflight >= self.opts.max_pd_requests:
            return self._reject(
                "overloaded", 503, f"the sidecar has {self._pd_inflight} P/D requests in flight (--max-pd-requests)"
            )
        if request.content_length is not None and not self._room_for(request.content_length):
            return self._buffer_full(request.content_length)
        self._pd_inflight += 1
        self.metrics.inflight.labels("pd").inc()
        held = 0
        try:
            progress.leg = "read"
            raw = await self._read_body(request)
            if raw is None:
                response = self._reject(
                    "body_too_large",
                    413,
                    f"the request body is over {self.opts.max_body_bytes} bytes (--max-body-bytes)",
                )
                response.force_close()  # the rest of the body is not read
                return response
            if not self._room_for(len(raw)):
                return self._buffer_full(len(raw))
            held = len(raw)
            self._buffered += held
            try:
                body = parse_object(raw)
            except ValueError as exc:
                return self._reject("malformed_body", 400, str(exc))
            self.metrics.pd_requests.inc()
            rid = str(uuid.uuid4())
            headers = forwarded(request.headers, frozenset({"host", "content-length", REQUEST_ID}))
            headers[REQUEST_ID] = rid
            headers.setdefault("Content-Type", "application/json")
            log.debug("event=pd_request connector=%s target=%s request_id=%s client_request_id=%r",
                      self.connector.name, target.address, rid, request.headers.get(REQUEST_ID))  # fmt: skip
            if self.connector.concurrent:
                return await self._concurrent_legs(request, target, body, raw, headers, progress)
            return await self._sequential_legs(request, target, body, raw, headers, progress)
        finally:
            self._buffered -= held
            self._pd_inflight -= 1
            self.metrics.inflight.labels("pd").dec()

    def _room_for(self, size: int) -> bool:
        return self._buffered + size <= self.opts.max_buffered_bytes

    def _buffer_full(self, size: int) -> web.Response:
        response = self._reject(
            "overloaded", 503, f"the P/D bodies in flight hold {self._buffered} bytes: {size} more would pass"
            " --max-buffered-bytes",
        )  # fmt: skip
        response.force_close()  # the body is not read
        return response

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The request body, or None when it is over ``--max-body-bytes`` (not read past that)."""
        limit = self.opts.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        raw, complete = await read_up_to(request.content, limit)
        return raw if complete else None

    async def _sequential_legs(
        self, request: web.Request, target: Target, body: dict[str, Any], raw: bytes, headers: CIMultiDict[str],
        progress: _Progress,
    ) -> web.StreamResponse:  # fmt: skip
        """NIXL v2 and shared storage: the prefill leg, then the decode leg built from its answer."""
        progress.leg = "prefill"
        try:
            answer = await self._prefill(
                target, request.raw_path, headers, self.connector.prefill_body(body, target, 0)
            )
            decode = self.connector.decode_body(body, raw, target, 0, answer)
        except BadPrefillAnswer as exc:
            return await self._prefill_failed(
                request, target, raw, PrefillFailure("bad_answer", 502, str(exc)), progress
            )
        except PrefillFailure as failure:
            return await self._prefill_failed(request, target, raw, failure, progress)
        progress.leg = "decode"
        streamed = body.get("stream") is True
        rewrite_to = cached_tokens(answer) if self.connector.rewrites_cached_tokens and not streamed else None
        return await self._relay(request, "POST", headers, decode, "remote", rewrite_to)

    async def _concurrent_legs(
        self, request: web.Request, target: Target, body: dict[str, Any], raw: bytes, headers: CIMultiDict[str],
        progress: _Progress,
    ) -> web.StreamResponse:  # fmt: skip
        """SGLang: both legs at once. A prefill failure known before the decode answer's headers is the client's (or
        falls back); one known after is logged and counted (the decode engine then reports its own error)."""
        room = secrets.randbits(63)
        prefill_body = self.connector.prefill_body(body, target, room)
        decode_body = self.connector.decode_body(body, raw, target, room, b"")
        progress.leg = "prefill"
        prefill = asyncio.create_task(self._prefill(target, request.raw_path, headers, prefill_body, keep=False))
        opening = asyncio.create_task(self._open_engine("POST", request.raw_path, headers, decode_body))
        try:
            await asyncio.wait({prefill, opening}, return_when=asyncio.FIRST_COMPLETED)
            failure = _failure_of(prefill)
            if failure is not None and not opening.done():
                opening.cancel()
                await _close_opened(opening)
                return await self._prefill_failed(request, target, raw, failure, progress)
            try:
                upstream = await opening
            except EngineError as exc:
                self.metrics.engine_errors.labels(exc.kind).inc()
                log.warning("event=local_engine_error kind=%s error=%r", exc.kind, str(exc))
                return exc.response("remote")
            failure = _failure_of(prefill)
            if failure is not None:
                upstream.close()
                return await self._prefill_failed(request, target, raw, failure, progress)
            progress.leg = "decode"
            response = await self._send(request, upstream, "remote", None)
            progress.leg = "prefill"
            with contextlib.suppress(PrefillFailure):
                await prefill  # bounded by --prefill-timeout; the answer is the client's already
            failure = _failure_of(prefill)
            if failure is not None:
                self.metrics.prefill_failures.labels(failure.kind).inc()
                log.warning("event=prefill_failed_after_decode target=%s kind=%s error=%r", target.address,
                            failure.kind, failure.message)  # fmt: skip
            return response
        finally:
            for task in (prefill, opening):
                task.cancel()
            await asyncio.gather(prefill, opening, return_exceptions=True)
            await _close_opened(opening)

    async def _prefill_failed(
        self, request: web.Request, target: Target, raw: bytes, failure: PrefillFailure, progress: _Progress
    ) -> web.StreamResponse:
        """The client's error, or with ``--prefill-failure local`` the request decoded locally, said."""
        self.metrics.prefill_failures.labels(failure.kind).inc()
        if self.opts.prefill_failure == "local" and failure.may_fall_back:
            self.metrics.local_fallbacks.labels(failure.kind).inc()
            log.warning("event=prefill_failed_local_fallback target=%s kind=%s status=%d error=%r",
                        target.address, failure.kind, failure.status, failure.message)  # fmt: skip
            progress.leg = "decode"
            headers = forwarded(request.headers, frozenset({"host", "content-length"}))
            return await self._relay(request, "POST", headers, raw, "local-fallback", None)
        log.warning("event=prefill_failed target=%s kind=%s status=%d error=%r", target.address, failure.kind,
                    failure.status, failure.message)  # fmt: skip
        return failure.response(target.address)

    # --- the legs ---

    async def _prefill(
        self, target: Target, path: str, headers: CIMultiDict[str], data: bytes, keep: bool = True
    ) -> bytes:
        """The prefill leg's answer (``keep``: read, at most MAX_PREFILL_ANSWER_BYTES; else read and dropped);
        PrefillFailure for an HTTP error, no connection, a timeout or an answer that is not a usable 2xx."""
        url = URL(f"{self._prefill_scheme}://{target.address}{path}", encoded=True)
        timeout = self.opts.prefill_timeout
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(
                    url, data=data, headers=headers, allow_redirects=False, ssl=self._prefill_ssl
                ) as resp:
                    if resp.status >= 400:
                        body, _ = await read_up_to(resp.content, MAX_ERROR_BODY_BYTES)
                        raise PrefillFailure(
                            "http_error", resp.status, f"HTTP {resp.status}: {body[:300].decode(errors='replace')}",
                            body, _is_json_object(body),
                        )  # fmt: skip
                    if not 200 <= resp.status < 300:
                        raise PrefillFailure("bad_answer", 502, f"HTTP {resp.status} (redirects are not followed)")
                    if not keep:
                        async for _ in resp.content.iter_any():
                            pass
                        return b""
                    answer, complete = await read_up_to(resp.content, MAX_PREFILL_ANSWER_BYTES)
                    if not complete:
                        raise PrefillFailure("bad_answer", 502, f"an answer over {MAX_PREFILL_ANSWER_BYTES} bytes")
                    return answer
        except aiohttp.ConnectionTimeoutError:
            raise PrefillFailure("timeout", 504, f"no connection within {self.opts.connect_timeout:g} s") from None
        except TimeoutError:
            raise PrefillFailure("timeout", 504, f"no complete answer within {timeout:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise PrefillFailure("connect_error", 502, f"cannot connect: {exc.os_error.strerror or exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PrefillFailure("connect_error", 502, f"the connection failed: {exc!r}") from None

    async def _open_engine(
        self, method: str, path: str, headers: CIMultiDict[str], data: bytes | aiohttp.StreamReader | None
    ) -> aiohttp.ClientResponse:
        """The local engine's answer, its headers read; EngineError when there is none."""
        url = URL(self.engine + path, encoded=True)
        where = f"the local engine at {self.engine}"
        try:
            return await self.session.request(
                method, url, data=data, headers=headers, allow_redirects=False, ssl=self._engine_ssl
            )
        except TimeoutError:
            raise EngineError("timeout", 504, f"{where} did not accept a connection in time") from None
        except aiohttp.ClientConnectorError as exc:
            # as llm-d's sidecar: an engine that refuses connections is not ready (yet)
            raise EngineError(
                "connect_error", 503, f"{where} is not reachable: {exc.os_error.strerror or exc}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError("connect_error", 502, f"{where} failed: {exc!r}") from None

    async def _relay(
        self, request: web.Request, method: str, headers: CIMultiDict[str],
        data: bytes | aiohttp.StreamReader | None, state: str | None, rewrite_to: int | None,
    ) -> web.StreamResponse:  # fmt: skip
        """A request to the local engine, its answer relayed to the client."""
        try:
            upstream = await self._open_engine(method, request.raw_path, headers, data)
        except EngineError as exc:
            self.metrics.engine_errors.labels(exc.kind).inc()
            log.warning("event=local_engine_error kind=%s error=%r", exc.kind, str(exc))
            return exc.response(state)
        return await self._send(request, upstream, state, rewrite_to)

    async def _send(
        self, request: web.Request, upstream: aiohttp.ClientResponse, state: str | None, rewrite_to: int | None
    ) -> web.StreamResponse:
        """Relay ``upstream`` to the client and finish the answer; the upstream connection is closed if it is not
        read to its end (a client gone, a broken engine stream). ``rewrite_to``: set a JSON answer's
        cached_tokens to it (buffered, at most MAX_REWRITE_BYTES; a longer answer passes untouched)."""
        try:
            headers = forwarded(upstream.headers)
            if state is not None:
                headers[STATE_HEADER] = state
            head = b""
            if rewrite_to is not None and _rewritable(upstream):
                head, complete = await read_up_to(upstream.content, MAX_REWRITE_BYTES)
                rewritten = rewrite_cached_tokens(head, rewrite_to) if complete else None
                if rewritten is not None:
                    head = rewritten
                    headers.popall("content-length", None)
                    headers["Content-Length"] = str(len(head))
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await response.prepare(request)
            if head:
                await response.write(head)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    self.metrics.engine_errors.labels("broken_stream").inc()
                    log.warning("event=local_engine_stream_broken error=%r (the client's connection is closed)", exc)
                    upstream.close()
                    if request.transport is not None:
                        request.transport.close()  # the client sees a cut answer, not a clean end
                    return response
                if not chunk:
                    break
                await response.write(chunk)  # ConnectionResetError: the client is gone
            await response.write_eof()
            upstream.release()
            return response
        except BaseException:
            upstream.close()
            raise


def _rewritable(upstream: aiohttp.ClientResponse) -> bool:
    encoding = upstream.headers.get("content-encoding", "identity").strip().lower()
    return 200 <= upstream.status < 300 and upstream.content_type == "application/json" and encoding in ("", "identity")


def _is_json_object(body: bytes) -> bool:
    try:
        parse_object(body)
    except ValueError:
        return False
    return True


def _failure_of(task: asyncio.Task[bytes]) -> PrefillFailure | None:
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    return exc if isinstance(exc, PrefillFailure) else None


async def _close_opened(task: asyncio.Task[aiohttp.ClientResponse]) -> None:
    """Close the answer a cancelled or unused ``_open_engine`` task got (its connection closed)."""
    with contextlib.suppress(BaseException):
        await task
    if task.done() and not task.cancelled() and task.exception() is None:
        task.result().close()
