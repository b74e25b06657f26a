"""What engines' /metrics expose for the engine-signals scraper (vLLM v1 with two data-parallel engines), a pool
config that scrapes them, and fake engines serving /metrics on loopback (``engines``: integration tests only)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from picker.config import PoolConfig, parse_settings
from tests.support.http_server import serve

# What a vLLM v1 server with two data-parallel engines exposes (prometheus_client's text format, vLLM's names,
# labels model_name + engine), cut to a few families.
VLLM_DP2 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12873.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.{deprecated}
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.234567e+06
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 812.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 812.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 97.3
""".replace("{deprecated}", "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")


# -- the scraper against real HTTP servers ----------------------------------------------------------------
def pool_config(addresses: dict[str, str], **em: Any) -> PoolConfig:
    # a timeout no loaded machine reaches: an outcome other than timeout never depends on speed
    engine_metrics = {"interval_ms": 10_000, "timeout_ms": 10_000, "stale_after_ms": 60_000, **em}
    return parse_settings(
        {
            "pool": {
                "backends": [{"name": n, "address": a} for n, a in addresses.items()],
                "engine_metrics": engine_metrics,
            }
        }
    ).pool


class Engine:
    """A real HTTP peer whose /metrics answer the test switches (body, status, hang, redirect)."""

    def __init__(self) -> None:
        self.body = VLLM_DP2
        self.status = 200
        self.hang = False
        self.hits = 0
        self.active = 0
        self.max_active = 0
        self.on_hit: Callable[[], None] | None = None
        self.released = asyncio.Event()
        self.stream: int | None = None  # stream this many bytes without a Content-Length
        self.delay = 0.0
        self.shared: dict[str, int] | None = None  # in flight across several engines: {"active", "max"}

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        if self.shared is not None:
            self.shared["active"] += 1
            self.shared["max"] = max(self.shared["max"], self.shared["active"])
        try:
            if self.on_hit is not None:
                self.on_hit()
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.hang:
                await self.released.wait()
            if self.status == 302:
                raise web.HTTPFound("/elsewhere")
            if self.stream is not None:
                resp = web.StreamResponse()
                resp.enable_chunked_encoding()
                await resp.prepare(request)
                for _ in range(self.stream // 65536 + 1):
                    await resp.write(b"x" * 65536)
                await resp.write_eof()
                return resp
            return web.Response(text=self.body, status=self.status)
        finally:
            self.active -= 1
            if self.shared is not None:
                self.shared["active"] -= 1

    async def elsewhere(self, request: web.Request) -> web.Response:
        return web.Response(text=VLLM_DP2)


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[tuple[Engine, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            e = Engine()
            url = await stack.enter_async_context(
                serve([web.get("/metrics", e.metrics), web.get("/elsewhere", e.elsewhere)])
            )
            out.append((e, url.removeprefix("http://")))
        try:
            yield out
        finally:
            for e, _ in out:
                e.released.set()


LABELS = ["model_name", "engine"]


class VllmPrefillRecords:
    """vLLM's two per-request prefill histograms (observed when a request finishes), per engine."""

    def __init__(self, engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        run = Gauge("vllm:num_requests_running", "Running.", LABELS, registry=r)
        wait = Gauge("vllm:num_requests_waiting", "Waiting.", LABELS, registry=r)
        self.time = Histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            LABELS, buckets=[0.1, 1.0, 10.0], registry=r,
        )  # fmt: skip
        self.tokens = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            LABELS, buckets=[100, 1000, 10000], registry=r,
        )  # fmt: skip
        for e in range(engines):
            run.labels("m", str(e)).set(0)
            wait.labels("m", str(e)).set(0)

    def finish(self, seconds: float, computed_tokens: int, engine: int = 0) -> None:
        self.time.labels("m", str(engine)).observe(seconds)
        self.tokens.labels("m", str(engine)).observe(computed_tokens)

    def body(self) -> str:
        return generate_latest(self.registry).decode()


def vllm_registry_body(engines: int, running: list[int], waiting: list[int], usage: list[float]) -> str:
    """A body rendered by prometheus_client (what vLLM serves through) with vLLM's names, label names and a
    histogram per engine, so the real formatting (label order, float rendering, _created lines) is read."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    g_run = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r)
    g_wait = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
    g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
    hist = Histogram("vllm:request_queue_time_seconds", "Queue time.", labels, buckets=[0.3, 1.0, 5.0], registry=r)
    for e in range(engines):
        lv = ("m", str(e))
        g_run.labels(*lv).set(running[e])
        g_wait.labels(*lv).set(waiting[e])
        g_kv.labels(*lv).set(usage[e])
        hist.labels(*lv).observe(0.5)
    return generate_latest(r).decode()
