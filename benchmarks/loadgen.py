"""Async load generator: replays a trace against a base URL and measures every request.

``run_trace(records, base_url, max_concurrency=32)`` sends each record at its arrival offset ``t``
(scaled by ``time_scale``), never more than ``max_concurrency`` at once, and the turns of a session in
order, each only after the previous turn finished. Requests are sent streaming (``stream: true`` and
``stream_options.include_usage`` are forced unless ``force_stream=False``). Each ``RequestResult``
holds the status, TTFT (first chunk with non-empty content/text), the gaps between a stream's later content
chunks (``token_gaps_s``: its inter-token latencies as the client sees them), end-to-end latency, usage (None
when the server sent none: unknown, not zero) and the ``x-kv-sim-name`` of the replica that served it.

Engine hit rate: ``scrape_prefix_cache_counters(urls)`` before and after the run, then
``engine_hit_rate(before, after)`` = Σ Δhits / Σ Δqueries over all replicas (tokens).
``gateway_cached_share(results)`` = Σ cached_tokens / Σ prompt_tokens over requests that reported usage.

Engine load over a run: ``EngineLoadPoller(replicas, period_s=0.1)`` reads every replica's
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` once per period while the trace runs
(``benchmarks.report.load_figures`` turns the samples into busy fractions and the share of the run during
which a replica was idle while another had requests waiting).

Example::

    before = await scrape_prefix_cache_counters(sim_urls)
    results = await run_trace(records, "http://127.0.0.1:10000", max_concurrency=32)
    after = await scrape_prefix_cache_counters(sim_urls)
    print(engine_hit_rate(before, after), gateway_cached_share(results))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.engine_sim.server import NAME_HEADER
from benchmarks.trace import TraceRecord

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-kv-epp-prefill"  # how kv-epp's P/D sidecar served a request (absent: passed through)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class RequestResult:
    """What happened to one trace record."""

    index: int  # position in the (time-sorted) trace
    session: str | None
    turn: int | None
    path: str
    scheduled_s: float  # the record's arrival offset after time scaling
    start_s: float  # when it was actually sent, from the run start
    status: int  # HTTP status; 0 when the connection failed
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    served_by: str | None = None  # x-kv-sim-name response header
    prefill: str | None = None  # x-kv-epp-prefill (kv-epp pd-sidecar's answers): remote, local-fallback, failed
    error: str | None = None
    # streamed: the time between each content chunk and the previous one, after the first (bound: one per token)
    token_gaps_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None


def _prepare_body(body: Mapping[str, Any], force_stream: bool) -> dict[str, Any]:
    out = dict(body)
    if force_stream:
        out["stream"] = True
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    return out


def _chunk_text(chunk: Mapping[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if isinstance(choice, Mapping):
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
            if isinstance(piece, str):
                text += piece
    return text


def _apply_usage(result: RequestResult, usage: Any) -> None:
    if not isinstance(usage, Mapping):
        return
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


async def send_request(
    http: aiohttp.ClientSession,
    base_url: str,
    record: TraceRecord,
    result: RequestResult,
    force_stream: bool = True,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send one record and fill ``result`` (never raises for HTTP or connection errors)."""
    body = _prepare_body(record.body, force_stream)
    sent = time.perf_counter()
    last_token = sent
    try:
        async with http.post(base_url.rstrip("/") + record.path, json=body, headers=headers) as resp:
            result.status = resp.status
            result.served_by = resp.headers.get(NAME_HEADER)
            result.prefill = resp.headers.get(PREFILL_HEADER)
            if resp.status >= 300:
                result.error = (await resp.text())[:500]
            elif resp.content_type == "text/event-stream":
                done = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if _chunk_text(chunk):
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - sent
                        else:
                            result.token_gaps_s.append(now - last_token)
                        last_token = now
                    if chunk.get("usage"):
                        _apply_usage(result, chunk["usage"])
                if not done:
                    result.error = "stream ended without [DONE]"
            else:
                data = await resp.json()
                result.ttft_s = time.perf_counter() - sent
                _apply_usage(result, data.get("usage"))
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.perf_counter() - sent


async def run_trace(
    records: Sequence[TraceRecord],
    base_url: str,
    max_concurrency: int = 32,
    time_scale: float = 1.0,
    force_stream: bool = True,
    request_timeout_s: float = 600.0,
    headers: Mapping[str, str] | None = None,
    session_header: str | None = "x-session-id",
) -> list[RequestResult]:
    """Replay ``records`` against ``base_url``; returns one result per record, in trace order.

    ``time_scale`` multiplies arrival offsets (0.5 = twice the rate). ``session_header`` (when set)
    carries the record's session id so a picker can use it.
    """
    ordered = sorted(records, key=lambda r: r.t)
    semaphore = asyncio.Semaphore(max_concurrency)  # bound: max_concurrency requests in flight
    previous_turn: dict[str, asyncio.Event] = {}  # session -> finished event of its latest turn
    order = sorted(range(len(ordered)), key=lambda i: (ordered[i].session or "", ordered[i].turn or 0, i))
    waits: dict[int, asyncio.Event | None] = {}
    finished: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(len(ordered))}
    for i in order:  # chain each session's turns
        session = ordered[i].session
        waits[i] = previous_turn.get(session) if session is not None else None
        if session is not None:
            previous_turn[session] = finished[i]
    results = [RequestResult(i, r.session, r.turn, r.path, r.t * time_scale, 0.0, 0) for i, r in enumerate(ordered)]
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    start = time.perf_counter()

    async def one(i: int) -> None:
        record = ordered[i]
        try:
            delay = results[i].scheduled_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            before = waits[i]
            if before is not None:
                await before.wait()
            async with semaphore:
                results[i].start_s = time.perf_counter() - start
                extra = dict(headers or {})
                extra.update(record.headers)  # a record's own headers (an experiment's session unit)
                if session_header and record.session is not None:
                    extra[session_header] = record.session
                await send_request(http, base_url, record, results[i], force_stream, extra)
        finally:
            finished[i].set()

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(one(i) for i in range(len(ordered))))
    ok = sum(r.ok for r in results)
    log.info("trace_replayed requests=%d ok=%d seconds=%.2f", len(results), ok, time.perf_counter() - start)
    return results


# -- engine metrics -----------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class PrefixCacheCounters:
    """One replica's prefix-cache counters at one instant (tokens)."""

    queries: float
    hits: float


def parse_prometheus_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as (name, labels, value)."""
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, value))
    return samples


def prefix_cache_counters(text: str) -> PrefixCacheCounters:
    """Sum of ``vllm:prefix_cache_queries_total`` / ``..._hits_total`` over all label sets."""
    queries = hits = 0.0
    for name, _, value in parse_prometheus_text(text):
        if name == "vllm:prefix_cache_queries_total":
            queries += value
        elif name == "vllm:prefix_cache_hits_total":
            hits += value
    return PrefixCacheCounters(queries, hits)


async def scrape_prefix_cache_counters(
    base_urls: Sequence[str], http: aiohttp.ClientSession | None = None
) -> dict[str, PrefixCacheCounters]:
    """GET ``/metrics`` of every replica; returns url → counters."""
    own = http is None
    session = http or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:

        async def one(url: str) -> tuple[str, PrefixCacheCounters]:
            async with session.get(url.rstrip("/") + "/metrics") as resp:
                resp.raise_for_status()
                return url, prefix_cache_counters(await resp.text())

        return dict(await asyncio.gather(*(one(u) for u in base_urls)))
    finally:
        if own:
            await session.close()


def engine_hit_rate(
    before: Mapping[str, PrefixCacheCounters], after: Mapping[str, PrefixCacheCounters]
) -> float | None:
    """Σ Δhits / Σ Δqueries over the replicas in ``after`` (a replica missing before counts from 0)."""
    d_hits = d_queries = 0.0
    for url, end in after.items():
        begin = before.get(url, PrefixCacheCounters(0.0, 0.0))
        d_hits += end.hits - begin.hits
        d_queries += end.queries - begin.queries
    return d_hits / d_queries if d_queries > 0 else None


def gateway_cached_share(results: Sequence[RequestResult]) -> float | None:
    """Σ cached_tokens / Σ prompt_tokens over requests that reported both (None if none did)."""
    cached = prompt = 0
    for r in results:
        if r.cached_tokens is not None and r.prompt_tokens:
            cached += r.cached_tokens
            prompt += r.prompt_tokens
    return cached / prompt if prompt else None


# -- engine load over time ------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class EngineLoadSample:
    """Every pool replica's queue at one poll: ``running``/``waiting`` by replica name (a replica that did
    not answer this poll is absent from both). ``t_s``: wall seconds since the poller started."""

    t_s: float
    running: dict[str, float]
    waiting: dict[str, float]


def engine_load(text: str) -> tuple[float, float]:
    """(``vllm:num_requests_running``, ``vllm:num_requests_waiting``) of one replica's /metrics, each summed
    over its label sets (one per engine)."""
    running = waiting = 0.0
    for name, _, value in parse_prometheus_text(text):
        if name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
    return running, waiting


async def sample_engine_load(
    http: aiohttp.ClientSession, replicas: Mapping[str, str]
) -> tuple[dict[str, float], dict[str, float]]:
    """One poll of ``replicas`` (name → base URL), concurrently: (running, waiting) by name; a replica that
    fails to answer (restarting, stopped) is left out of both."""

    async def one(name: str, url: str) -> tuple[str, tuple[float, float] | None]:
        try:
            async with http.get(url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    return name, None
                return name, engine_load(await resp.text())
        except (TimeoutError, aiohttp.ClientError):
            return name, None

    answers = await asyncio.gather(*(one(n, u) for n, u in replicas.items()))
    running = {n: v[0] for n, v in answers if v is not None}
    waiting = {n: v[1] for n, v in answers if v is not None}
    return running, waiting


@dataclass(slots=True)
class EngineLoadPoller:
    """Polls every pool replica's running/waiting gauges each ``period_s`` (wall) until stopped.

    ``replicas()`` is called at every poll (name → base URL), so a replica added mid-run is sampled from
    then on. Polls never overlap: the next one starts at the next period boundary after the previous one
    ended (a slow poll skips boundaries rather than queueing them). Bound: at most ``max_samples`` samples
    (36,000 = one hour at 100 ms); past it polling stops and ``truncated`` is set (no eviction: the figures
    cover the run's first ``max_samples`` polls, and say so)."""

    replicas: Callable[[], Mapping[str, str]]
    period_s: float = 0.1
    max_samples: int = 36_000
    timeout_s: float = 2.0
    samples: list[EngineLoadSample] = field(default_factory=list)
    truncated: bool = False
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start polling (the first poll is immediate)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-load-poller")

    async def stop(self) -> list[EngineLoadSample]:
        """Stop polling (a poll in progress is cancelled and not recorded); returns the samples."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        return self.samples

    async def join(self) -> list[EngineLoadSample]:
        """Wait until polling ends by itself (at ``max_samples``); returns the samples."""
        if self._task is not None:
            await self._task
        return self.samples

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=64)
        start = time.perf_counter()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            while len(self.samples) < self.max_samples:
                t = time.perf_counter() - start
                running, waiting = await sample_engine_load(http, dict(self.replicas()))
                self.samples.append(EngineLoadSample(round(t, 4), running, waiting))
                elapsed = time.perf_counter() - start
                await asyncio.sleep(self.period_s - (elapsed % self.period_s))
            self.truncated = True
