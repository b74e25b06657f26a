"""Overhead of the picker through a real Envoy: picker vs a no-op Python ext_proc (the floor) vs
Envoy alone, against a trivial upstream (an Envoy direct_response listener reached on 127.0.0.N).

    python -m benchmarks.overhead --out DIR [--quick] [--body-mode FULL_DUPLEX_STREAMED|BUFFERED]
        [--compare-modes] [--variant LABEL:KEY=VALUE,...] [--streaming-only | --no-streaming]
        [--stream-gap-ms MS]

For each body size (4 KB, 220 KB) and backend count (2, 16, 128): a one-connection phase of sequential
requests (p50/p99, and what each path adds over Envoy alone) and an 8-connection phase (throughput).
Every path reports the front Envoy's upstream connections vs requests (the upstream reads each body
before answering, so connections are reused) and the ext_proc server's CPU per request (/proc). The
floor follows the processing modes of the bootstrap generated for the picker (one floor per distinct
modes). The streaming row: 256-token SSE responses from ``benchmarks.sse_upstream``, 16 clients, through
every path: chunks/s (events arrived within the window) and the ext_proc server's CPU per streamed and
per non-streamed request. ``--compare-modes`` / ``--variant`` add picker configurations, measured on every
row next to the default. Also the decision CPU (parse + prefix key + pick) measured in-process. Writes
DIR/results.json (docs/benchmarks.md shape, more keys) and prints the tables. The load generator shares the
machine's cores with Envoy and the ext_proc server: figures are comparable with each other within one
run, not with other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from benchmarks.httpload import LoadResult, run_load
from benchmarks.sse_upstream import READY_PREFIX as SSE_READY
from benchmarks.stack import (
    ManagedProcess,
    envoy_binary,
    free_port,
    make_workdir,
    parse_envoy_stats,
    spawn,
    spawn_ready_line,
    start_envoy,
    start_picker,
    wait_http,
)
from picker.api import EnvoyOptions, Exchange, Inbound, bootstrap_yaml, build_app, parse_settings

BODY_SIZES = (4096, 220 * 1024)
BACKEND_COUNTS = (2, 16, 128)
N_PROMPTS = 64  # distinct system prompts rotated by the load generator
STREAM_TOKENS = 256  # SSE token chunks per streamed response (the streaming row)
STREAM_CLIENTS = 16
STREAM_GAP_MS = 1.0  # the upstream's pause between chunks in `python -m benchmarks.overhead`


def chat_bodies(size: int, n: int = N_PROMPTS, stream: bool = False) -> list[bytes]:
    """``n`` chat bodies of about ``size`` bytes with distinct system prompts (``stream``: SSE asked for,
    with usage in the last chunk)."""
    out = []
    for i in range(n):
        empty = json.dumps(chat_body("", stream))
        filler = f"system prompt {i}: " + ("lorem ipsum dolor sit amet " * (size // 27 + 1))
        out.append(json.dumps(chat_body(filler[: max(0, size - len(empty))], stream)).encode())
    return out


def chat_body(system: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "bench-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


UPSTREAM_BODY = '{"ok":true}'


def upstream_bootstrap(port: int, admin_port: int, body: str = UPSTREAM_BODY) -> dict[str, Any]:
    """An Envoy that answers every request itself (``body``, status 200): the trivial upstream, listening on all
    of 127/8.

    The buffer filter holds the request until its body has arrived, so the direct response goes out after
    the whole request was read: answered before its body, a request would leave the connection unusable
    and the front Envoy would open a new upstream connection for every request (measured: 2,300
    connections for 2,300 requests, 0.1-0.15 ms added to every path)."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "upstream",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": body}},
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.buffer",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                    "max_request_bytes": 16 << 20,
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "upstream",
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
                    "per_connection_buffer_limit_bytes": 16 << 20,
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ]
        },
    }


def start_upstream(workdir: Path, body: str = UPSTREAM_BODY) -> tuple[ManagedProcess, int]:
    port, admin = free_port(), free_port()
    cfg = workdir / "upstream.yaml"
    cfg.write_text(yaml.safe_dump(upstream_bootstrap(port, admin, body)))
    mp = spawn(
        "upstream",
        [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"],
        workdir,
    )
    wait_http(f"http://127.0.0.1:{admin}/ready", proc=mp.proc)
    return mp, port


def start_sse_upstream(workdir: Path, tokens: int = STREAM_TOKENS, gap_ms: float = 0.0) -> tuple[ManagedProcess, int]:
    """The streaming upstream (``benchmarks.sse_upstream``): ``tokens`` SSE chunks per streamed request,
    ``gap_ms`` apart (0: as fast as the path takes them)."""
    argv = [sys.executable, "-m", "benchmarks.sse_upstream", "--port", "0", "--tokens", str(tokens),
            "--gap-ms", str(gap_ms)]  # fmt: skip
    mp, ready = spawn_ready_line("sse-upstream", argv, workdir, SSE_READY)
    return mp, int(ready.rpartition("port=")[2])


def backend_addresses(n: int, port: int) -> list[str]:
    return [f"127.0.0.{i + 1}:{port}" for i in range(n)]


@dataclass(frozen=True)
class Variant:
    """One picker configuration: EnvoyOptions fields and picker config keys over the harness's defaults.

    Every variant is measured on the same rows as the others (and gets its own no-op floor when its
    generated ext_proc processing modes differ from the first variant's)."""

    label: str
    envoy: dict[str, Any] = field(default_factory=dict)
    picker: dict[str, Any] = field(default_factory=dict)


DEFAULT = Variant("default")


def parse_variant(spec: str) -> Variant:
    """``LABEL:field=value[,field=value...]``: a key naming an EnvoyOptions field sets it; ``picker.a.b=v``
    sets the picker's config key ``a.b``. Values are YAML (``true``, ``5``, ``BUFFERED``)."""
    label, _, rest = spec.partition(":")
    names = {f.name for f in fields(EnvoyOptions)}
    envoy: dict[str, Any] = {}
    picker: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: {item!r} is not key=value")
        value = yaml.safe_load(raw)
        if key.startswith("picker."):
            node = picker
            *parents, last = key.removeprefix("picker.").split(".")
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = value
        elif key in names:
            envoy[key] = value
        else:
            raise ValueError(f"variant {spec!r}: {key!r} is neither an EnvoyOptions field nor picker.<key>")
    return Variant(label or "variant", envoy, picker)


def compare_modes_variant() -> Variant:
    """The configuration that streams every response chunk through the picker (``full-response``), when
    EnvoyOptions offers a response-mode switch: a field whose name has "response" and "mode" and whose
    Literal type lists a value with "full" in it (today ``response_mode="full"``: full-duplex echo in
    full-duplex body mode, STREAMED answers in BUFFERED mode)."""
    hints = get_type_hints(EnvoyOptions)
    for f in fields(EnvoyOptions):
        if "response" in f.name and "mode" in f.name:
            full = [v for v in get_args(hints[f.name]) if isinstance(v, str) and "full" in v.lower()]
            if full:
                if f.default == full[0]:
                    print(f"--compare-modes: {f.name}={full[0]!r} is already the default", file=sys.stderr)
                return Variant("full-response", {f.name: full[0]})
    raise SystemExit(
        "--compare-modes: EnvoyOptions has no response-mode field with a full value yet; "
        "give the second configuration with --variant LABEL:field=value"
    )


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ext_proc_settings(opts: EnvoyOptions) -> dict[str, Any] | None:
    """The ext_proc filter's processing_mode (and allow_mode_override when set) in the bootstrap generated
    for ``opts``: what the no-op floor must follow to do the same protocol work as the picker."""

    def find(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if node.get("name") == "envoy.filters.http.ext_proc":
                return dict(node["typed_config"])
            for v in node.values():
                if (hit := find(v)) is not None:
                    return hit
        elif isinstance(node, list):
            for v in node:
                if (hit := find(v)) is not None:
                    return hit
        return None

    cfg = find(yaml.safe_load(bootstrap_yaml(opts)))
    if cfg is None:
        return None
    out = {"processing_mode": cfg.get("processing_mode", {})}
    keys = ("allow_mode_override", "allowed_override_modes", "send_body_without_waiting_for_header_response",
            "observability_mode")  # fmt: skip
    for key in keys:
        if key in cfg:
            out[key] = cfg[key]
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    after = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")


def envoy_upstream_stats(admin_port: int) -> dict[str, int]:
    """The front Envoy's pool cluster counters: connections opened vs requests sent upstream."""
    query = urllib.parse.quote("^cluster.inference_pool.upstream_(cx|rq)_total$")
    url = f"http://127.0.0.1:{admin_port}/stats?filter={query}"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {k.rpartition(".")[2].replace("_total", ""): int(v) for k, v in parse_envoy_stats(text).items()}
    return {"upstream_cx": out.get("upstream_cx", -1), "upstream_rq": out.get("upstream_rq", -1)}


def _phase(res: LoadResult, cpu_s: float | None) -> dict[str, Any]:
    return {
        "requests": res.requests,
        "rps": round(res.rps, 1),
        "p50_ms": round(res.percentile(0.50), 3),
        "p99_ms": round(res.percentile(0.99), 3),
        "errors": res.errors,
        "non_200": sum(v for k, v in res.statuses.items() if k != 200),
        "cpu_us_per_req": round(cpu_s / res.completed_total * 1e6, 1)
        if cpu_s is not None and res.completed_total
        else None,
    }


def summarize(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    return {
        "rps": high["rps"],
        "p50_ms": low["p50_ms"],
        "p99_ms": low["p99_ms"],
        "loaded_p50_ms": high["p50_ms"],
        "loaded_p99_ms": high["p99_ms"],
        "latency_requests": low["requests"],
        "errors": low["errors"] + high["errors"],
        "non_200": low["non_200"] + high["non_200"],
        "cpu_us_per_req": high["cpu_us_per_req"],  # the ext_proc server's, throughput phase
    }


async def _timed_load(
    port: int, bodies: list[bytes], seconds: float, concurrency: int, pid: int | None, sse: bool = False
) -> dict[str, Any]:
    before = proc_cpu_s(pid) if pid else None
    res = await run_load(
        "127.0.0.1", port, "/v1/chat/completions", bodies, concurrency=concurrency, seconds=seconds, warmup=0.5, sse=sse
    )
    cpu = proc_cpu_s(pid) - before if pid and before is not None else None
    out = _phase(res, cpu)
    if sse:
        out["chunks"] = res.chunks
        out["chunks_per_s"] = round(res.chunks_per_s, 1)
        out["chunks_per_req"] = round(res.events_total / res.completed_total, 2) if res.completed_total else None
        out["ttfb_p50_ms"] = round(statistics.median(res.ttfb_ms), 3) if res.ttfb_ms else None
    return out


async def measure(
    port: int, bodies: list[bytes], seconds: float, concurrency: int, pid: int | None = None
) -> dict[str, Any]:
    """One connection, sequential requests (latency), then ``concurrency`` connections (throughput)."""
    low = await _timed_load(port, bodies, seconds, 1, pid)
    high = await _timed_load(port, bodies, seconds, concurrency, pid)
    return summarize(low, high)


def decision_cpu_us(body_bytes: int, backends: int, iterations: int = 2000) -> float:
    """Median CPU time of the picker's request path for one request (parse, prefix key, pick, lease,
    recording: ``RequestPath.route``, what the ext_proc stream calls), in µs, with ~16 requests in
    flight so every decision sees changed load. Raises if a request is not routed."""
    settings = parse_settings(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {
                "backends": [{"name": f"b{i}", "address": a} for i, a in enumerate(backend_addresses(backends, 8000))]
            },
        }
    )
    path = build_app(settings).path
    bodies = chat_bodies(body_bytes)

    async def run() -> list[float]:
        samples = []
        open_: list[Exchange] = []
        for i in range(iterations):
            req = Inbound("/v1/chat/completions", {":method": "POST"}, bodies[i % len(bodies)])
            t0 = time.perf_counter()
            ex = await path.route(req)  # no I/O without Tier 4: this await never suspends
            samples.append(time.perf_counter() - t0)
            if not isinstance(ex, Exchange):
                raise RuntimeError(f"request not routed: {ex}")
            open_.append(ex)
            if len(open_) > 16:  # keep ~16 requests in flight, as under load
                open_.pop(0).end(completed=True)
        return samples

    return round(statistics.median(asyncio.run(run())) * 1e6, 2)


def _envoy_options(
    body_mode: str,
    picker_address: str | None,
    backends: list[str] | None = None,
    picker_tls: bool = True,
    extra: dict[str, Any] | None = None,
) -> EnvoyOptions:
    """The harness's Envoy; ``extra`` (a variant's EnvoyOptions fields) wins over the other arguments."""
    return EnvoyOptions(**{
        "listen_port": free_port(), "listen_address": "127.0.0.1", "admin_port": free_port(),
        "picker_address": picker_address, "body_mode": body_mode, "backends": tuple(backends or ()),
        "picker_tls": picker_tls, **(extra or {}),
    })  # fmt: skip


def _through_envoy(workdir: Path, opts: EnvoyOptions, run_phases: Any, pid: int | None = None) -> dict[str, Any]:
    """Start an Envoy for ``opts``, run ``run_phases(port, pid)`` (a coroutine function) against it, add
    the Envoy's upstream connection counters (reuse check) and stop it."""
    envoy = start_envoy(opts, workdir)
    try:
        out: dict[str, Any] = asyncio.run(run_phases(opts.listen_port, pid))
        out.update(envoy_upstream_stats(opts.admin_port))
        return out
    finally:
        envoy.stop()


def picker_config(addrs: list[str], variant: Variant, plaintext: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "pool": {"backends": [{"name": f"b{i}", "address": a} for i, a in enumerate(addrs)]},
    }
    if plaintext:
        cfg["extproc"] = {"tls": {"mode": "plaintext"}}
    return merged(cfg, variant.picker)


def _floor_groups(
    variants: list[Variant], body_mode: str, addrs: list[str]
) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Variants grouped by the ext_proc settings of their generated bootstrap: one floor per group, named
    after its first variant; value: (settings, the variants it serves)."""
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    by_key: dict[str, str] = {}
    for v in variants:
        settings = ext_proc_settings(_envoy_options(body_mode, "127.0.0.1:1", addrs, extra=v.envoy)) or {}
        key = json.dumps(settings, sort_keys=True)
        if key not in by_key:
            by_key[key] = v.label
            groups[v.label] = (settings, [])
        groups[by_key[key]][1].append(v.label)
    return groups


def run_paths(
    workdir: Path,
    addrs: list[str],
    variants: list[Variant],
    body_mode: str,
    phases: Any,
    picker_plaintext: bool = False,
) -> dict[str, Any]:
    """Envoy alone, the no-op floor(s) and the picker (each variant) through ``phases``, on the same
    backends. Returns {"envoy_only": ..., "floors": {label: ...}, "pickers": {label: ...}}."""
    out: dict[str, Any] = {"floors": {}, "pickers": {}}
    out["envoy_only"] = _through_envoy(workdir, _envoy_options(body_mode, None, addrs), phases)
    first = variants[0]
    for label, (settings, served) in _floor_groups(variants, body_mode, addrs).items():
        envoy_extra = next(v for v in variants if v.label == label).envoy
        # Port 0 and the ready line: traffic must not reach Envoy before the floor listens (Envoy answers
        # 500 while its ext_proc cluster refuses connections), and no port is picked then released.
        argv = [sys.executable, "-m", "benchmarks.noop_extproc", "--port", "0", "--dest", ",".join(addrs),
                "--processing-mode", json.dumps(settings.get("processing_mode", {}))]  # fmt: skip
        # The floor stays plaintext, the picker speaks TLS (its default, what users run): picker vs floor
        # then includes TLS's cost instead of hiding it (--picker-plaintext measures the picker without it).
        noop, ready = spawn_ready_line("noop-extproc", argv, workdir, "noop-extproc ready")
        try:
            opts = _envoy_options(
                body_mode, ready.rpartition("extproc=")[2], addrs, picker_tls=False, extra=envoy_extra
            )
            floor = _through_envoy(workdir, opts, phases, noop.proc.pid)
        finally:
            noop.stop()
        floor["ext_proc"] = settings
        floor["serves"] = served
        out["floors"][label] = floor
    for v in variants:
        picker = start_picker(picker_config(addrs, v, picker_plaintext), workdir, name=f"picker-{v.label}")
        try:
            opts = _envoy_options(
                body_mode, f"127.0.0.1:{picker.extproc_port}", addrs, picker_tls=picker.tls, extra=v.envoy
            )
            res = _through_envoy(workdir, opts, phases, picker.process.proc.pid)
        finally:
            picker.stop()
        res["floor"] = next(label for label, f in out["floors"].items() if v.label in f["serves"])
        res["variant"] = {"envoy": v.envoy, "picker": v.picker}
        out["pickers"][v.label] = res
    out["floor"] = out["floors"][first.label]
    out["picker"] = out["pickers"][first.label]
    return out


def measure_row(
    workdir: Path,
    addrs: list[str],
    size: int,
    body_mode: str,
    seconds: float,
    conc: int,
    picker_plaintext: bool = False,
    variants: list[Variant] | None = None,
) -> dict[str, Any]:
    """Envoy alone, the no-op floor and the picker on the same bodies and backends: one connection
    (latency: p50/p99, added over Envoy alone) then ``conc`` connections (throughput)."""
    variants = variants or [DEFAULT]
    bodies = chat_bodies(size)

    async def phases(port: int, pid: int | None) -> dict[str, Any]:
        return await measure(port, bodies, seconds, conc, pid)

    row: dict[str, Any] = {"body_bytes": size, "backends": len(addrs), "index_entries": 0, "body_mode": body_mode}
    row.update(run_paths(workdir, addrs, variants, body_mode, phases, picker_plaintext))
    row["picker_tls"] = not picker_plaintext
    env = row["envoy_only"]
    for res in [*row["floors"].values(), *row["pickers"].values()]:
        res["p50_added_ms"] = round(res["p50_ms"] - env["p50_ms"], 3)
        res["p99_added_ms"] = round(res["p99_ms"] - env["p99_ms"], 3)
        res["rps_vs_envoy"] = round(res["rps"] / env["rps"], 3) if env["rps"] else None
    for res in row["pickers"].values():
        floor = row["floors"][res["floor"]]
        res["throughput_ratio"] = round(res["rps"] / floor["rps"], 3) if floor["rps"] else None
        res["p50_delta_ms"] = round(res["p50_ms"] - floor["p50_ms"], 3)
    floor, pick = row["floor"], row["picker"]
    row["throughput_ratio"] = pick["throughput_ratio"]
    row["p50_delta_ms"] = pick["p50_delta_ms"]
    row["p99_delta_ms"] = round(pick["p99_ms"] - floor["p99_ms"], 3)
    row["p50_added_ms"] = pick["p50_added_ms"]
    row["p99_added_ms"] = pick["p99_added_ms"]
    return row


def measure_streaming(
    workdir: Path,
    up_port: int,
    seconds: float,
    clients: int = STREAM_CLIENTS,
    variants: list[Variant] | None = None,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    picker_plaintext: bool = False,
    tokens: int = STREAM_TOKENS,
) -> dict[str, Any]:
    """The streaming row: through each path, ``clients`` connections of non-streamed requests, then of
    streamed ones (``tokens`` SSE chunks each, from the SSE upstream on ``up_port``), 4 KB bodies, 2
    backends. Per path: chunks/s, and the ext_proc server's CPU per request in both phases."""
    variants = variants or [DEFAULT]
    addrs = backend_addresses(2, up_port)
    plain = chat_bodies(4096)
    streamed = chat_bodies(4096, stream=True)

    async def phases(port: int, pid: int | None) -> dict[str, Any]:
        non = await _timed_load(port, plain, seconds, clients, pid)
        st = await _timed_load(port, streamed, seconds, clients, pid, sse=True)
        out = {"streamed": st, "non_streamed": non}
        if st["cpu_us_per_req"] is not None and non["cpu_us_per_req"]:
            out["cpu_ratio_streamed_vs_non_streamed"] = round(st["cpu_us_per_req"] / non["cpu_us_per_req"], 2)
        return out

    sec: dict[str, Any] = {"tokens": tokens, "clients": clients, "body_bytes": 4096, "backends": 2}
    sec.update(run_paths(workdir, addrs, variants, body_mode, phases, picker_plaintext))
    env = sec["envoy_only"]["streamed"]["chunks_per_s"]
    for res in [*sec["floors"].values(), *sec["pickers"].values()]:
        res["chunks_ratio_vs_envoy"] = round(res["streamed"]["chunks_per_s"] / env, 3) if env else None
    return sec


def run(
    out: Path,
    quick: bool,
    body_mode: str,
    seconds: float,
    concurrency: int,
    picker_plaintext: bool = False,
    variants: list[Variant] | None = None,
    streaming: bool = True,
    stream_clients: int = STREAM_CLIENTS,
    stream_gap_ms: float = 0.0,
    rows: bool = True,
) -> dict[str, Any]:
    variants = variants or [DEFAULT]
    workdir = make_workdir("kv-epp-overhead-")
    counts = ((2, 128) if quick else BACKEND_COUNTS) if rows else ()
    runs = []
    stream_sec = None
    upstream, up_port = start_upstream(workdir) if counts else (None, 0)
    try:
        for n in counts:
            for size in BODY_SIZES:
                row = measure_row(
                    workdir, backend_addresses(n, up_port), size, body_mode, seconds, concurrency, picker_plaintext,
                    variants,
                )  # fmt: skip
                runs.append(row)
                print(format_row(row), flush=True)
    finally:
        if upstream is not None:
            upstream.stop()
    if streaming:
        sse, sse_port = start_sse_upstream(workdir, gap_ms=stream_gap_ms)
        try:
            stream_sec = measure_streaming(
                workdir, sse_port, seconds, stream_clients, variants, body_mode, picker_plaintext
            )
        finally:
            sse.stop()
        stream_sec["gap_ms"] = stream_gap_ms
    results: dict[str, Any] = {
        "params": {
            "seconds": seconds,
            "concurrency": concurrency,
            "body_mode": body_mode,
            "prompts": N_PROMPTS,
            "picker_tls": not picker_plaintext,
            "variants": {v.label: {"envoy": v.envoy, "picker": v.picker} for v in variants},
            "load_average": os.getloadavg(),
            "git": _git_state(),
        },
        "runs": runs,
        "latency_row": latency_row(runs),
        "streaming": stream_sec,
        "decision_cpu_us": {
            "body_4k_backends_2": decision_cpu_us(4096, 2),
            "body_220k_backends_128": decision_cpu_us(220 * 1024, 128),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def _git_state() -> str | None:
    """The tree measured (``<commit>[-dirty]``): the data plane may be changing under the benchmark."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def latency_row(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The issue's headline row: 4 KB, the fewest backends; one connection (p50/p99 added over Envoy
    alone) and the throughput phase."""
    rows = [r for r in runs if r["body_bytes"] == 4096]
    if not rows:
        return None
    r = min(rows, key=lambda x: x["backends"])
    paths = _paths(r)
    keys = ("p50_ms", "p99_ms", "p50_added_ms", "p99_added_ms", "rps", "rps_vs_envoy", "cpu_us_per_req",
            "upstream_cx", "upstream_rq", "latency_requests")  # fmt: skip
    return {
        "body_bytes": r["body_bytes"],
        "backends": r["backends"],
        "paths": {name: {k: p.get(k) for k in keys} for name, p in paths.items()},
    }


def _bad(res: dict[str, Any]) -> int:
    return int(res["non_200"] + res["errors"])


def format_row(r: dict[str, Any]) -> str:
    e, f, p = r["envoy_only"], r["floor"], r["picker"]
    paths = _paths(r)
    bad = {n: _bad(v) for n, v in paths.items() if _bad(v)}
    warn = f" | FAILED REQUESTS {bad}: figures invalid" if bad else ""
    warn += "" if r.get("picker_tls", True) else " | picker plaintext"
    cx = " ".join(f"{n}={v['upstream_cx']}/{v['upstream_rq']}" for n, v in paths.items())
    line = (
        f"body={r['body_bytes']:>6} backends={r['backends']:>3} | rps envoy={e['rps']:>7.0f} floor={f['rps']:>7.0f} "
        f"picker={p['rps']:>7.0f} ratio={r['throughput_ratio']} | p50 envoy={e['p50_ms']:.2f} floor={f['p50_ms']:.2f} "
        f"picker={p['p50_ms']:.2f} (+{r['p50_added_ms']:.2f} over envoy, +{r['p50_delta_ms']:.2f} over floor) "
        f"| p99 envoy={e['p99_ms']:.2f} floor={f['p99_ms']:.2f} picker={p['p99_ms']:.2f}"
        + warn
        + f"\n    upstream connections/requests: {cx}"
    )
    for label, v in list(r["pickers"].items())[1:]:
        line += (
            f"\n    picker[{label}]: rps={v['rps']:.0f} ratio={v['throughput_ratio']} p50={v['p50_ms']:.2f} "
            f"(+{v['p50_added_ms']:.2f} over envoy) p99={v['p99_ms']:.2f}"
        )
    return line


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _paths(sec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    paths = {"envoy_only": sec["envoy_only"], **{f"floor[{k}]": v for k, v in sec["floors"].items()}}
    paths.update({f"picker[{k}]": v for k, v in sec["pickers"].items()})
    return paths


def format_tables(res: dict[str, Any]) -> str:
    lines = []
    lr = res.get("latency_row")
    if lr:
        lines.append(
            f"\nLatency (1 connection, sequential, {lr['body_bytes']} B, {lr['backends']} backends) and "
            f"throughput ({res['params']['concurrency']} connections)"
        )
        header = ["path", "p50 ms", "p99 ms", "+p50 vs Envoy", "+p99 vs Envoy", "rps", "rps vs Envoy",
                  "ext_proc CPU µs/req", "upstream cx/rq"]  # fmt: skip
        rows = [
            [
                name,
                f"{p['p50_ms']:.3f}",
                f"{p['p99_ms']:.3f}",
                _fmt(p["p50_added_ms"]),
                _fmt(p["p99_added_ms"]),
                f"{p['rps']:.0f}",
                _fmt(p["rps_vs_envoy"]),
                _fmt(p["cpu_us_per_req"]),
                f"{p['upstream_cx']}/{p['upstream_rq']}",
            ]
            for name, p in lr["paths"].items()
        ]
        lines += _table(header, rows)
    st = res.get("streaming")
    if st:
        lines.append(
            f"\nStreaming ({st['tokens']}-token SSE responses, {st['clients']} clients, {st['body_bytes']} B bodies)"
        )
        header = ["path", "chunks/s", "vs Envoy", "stream p50 ms", "chunks/req", "TTFB p50 ms", "CPU µs/streamed req",
                  "CPU µs/non-streamed req", "streamed/non-streamed CPU", "failed", "upstream cx/rq"]  # fmt: skip
        rows = []
        for name, p in _paths(st).items():
            s, n = p["streamed"], p["non_streamed"]
            rows.append(
                [
                    name,
                    f"{s['chunks_per_s']:.0f}",
                    _fmt(p.get("chunks_ratio_vs_envoy", 1.0)),
                    f"{s['p50_ms']:.0f}",
                    _fmt(s["chunks_per_req"]),
                    _fmt(s["ttfb_p50_ms"]),
                    _fmt(s["cpu_us_per_req"]),
                    _fmt(n["cpu_us_per_req"]),
                    _fmt(p.get("cpu_ratio_streamed_vs_non_streamed")),
                    str(_bad(s) + _bad(n)),
                    f"{p['upstream_cx']}/{p['upstream_rq']}",
                ]
            )
        lines += _table(header, rows)
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else (f"{v:.0f}" if isinstance(v, float) else str(v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/overhead"))
    ap.add_argument("--quick", action="store_true", help="2 and 128 backends only, shorter phases")
    ap.add_argument("--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per phase")
    ap.add_argument("--concurrency", type=int, default=8, help="connections in the throughput phase")
    ap.add_argument("--stream-clients", type=int, default=STREAM_CLIENTS, help="connections in the streaming row")
    ap.add_argument("--no-streaming", action="store_true", help="skip the streaming row")
    ap.add_argument("--streaming-only", action="store_true", help="only the streaming row")
    ap.add_argument(
        "--stream-gap-ms", type=float, default=STREAM_GAP_MS,
        help="pause between an SSE stream's chunks at the upstream (default 1 ms: paced like an engine, each "
        "chunk reaches Envoy alone, so a path that handles chunks pays per chunk; 0: as fast as the path takes "
        "them, a saturation test where Envoy reads many chunks at once and the 2 cores' contention dominates)",
    )  # fmt: skip
    ap.add_argument("--picker-plaintext", action="store_true", help="picker without TLS (default: TLS, as deployed)")
    ap.add_argument(
        "--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="a further picker configuration measured on every row next to the default: KEY is an EnvoyOptions "
        "field (e.g. body_mode=BUFFERED) or picker.<config key>; repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--compare-modes", action="store_true",
        help="add the configuration that streams every response chunk through the picker (EnvoyOptions' "
        "response-mode switch, e.g. response_mode=full) next to the default",
    )  # fmt: skip
    a = ap.parse_args()
    seconds = a.seconds if a.seconds is not None else (2.0 if a.quick else 4.0)
    variants = [DEFAULT]
    if a.compare_modes:
        variants.append(compare_modes_variant())
    variants += [parse_variant(v) for v in a.variant]
    if len({v.label for v in variants}) != len(variants):
        raise SystemExit("variant labels must differ")
    res = run(
        a.out, a.quick, a.body_mode, seconds, a.concurrency, a.picker_plaintext, variants,
        streaming=not a.no_streaming, stream_clients=a.stream_clients, stream_gap_ms=a.stream_gap_ms,
        rows=not a.streaming_only,
    )  # fmt: skip
    print(format_tables(res))
    print("\ndecision CPU (parse + key + pick), median:", json.dumps(res["decision_cpu_us"]))
    print(f"load average at the end: {os.getloadavg()}")
    print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
