"""Overhead of the picker through a real Envoy: picker vs a no-op Python ext_proc (the floor) vs
Envoy alone, against a trivial upstream (an Envoy direct_response listener reached on 127.0.0.N).

    python -m benchmarks.overhead --out DIR [--quick] [--body-mode FULL_DUPLEX_STREAMED|BUFFERED]

For each body size (4 KB, 220 KB) and backend count (2, 16, 128): a low-load phase (1 connection)
for p50/p99 and a high-load phase (N connections) for throughput. Also the decision CPU
(parse + prefix key + pick) measured in-process. Writes DIR/results.json (BENCHMARKS.md shape) and
prints a table. The load generator shares the machine's cores with Envoy and the ext_proc server:
figures are comparable with each other within one run, not with other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.httpload import LoadResult, run_load
from benchmarks.stack import (
    ManagedProcess,
    free_port,
    make_workdir,
    spawn,
    spawn_ready_line,
    start_envoy,
    start_picker,
    wait_http,
)
from picker.api import EnvoyOptions, Exchange, Inbound, PickerApp, parse_settings

BODY_SIZES = (4096, 220 * 1024)
BACKEND_COUNTS = (2, 16, 128)
N_PROMPTS = 64  # distinct system prompts rotated by the load generator


def chat_bodies(size: int, n: int = N_PROMPTS) -> list[bytes]:
    """``n`` chat bodies of about ``size`` bytes with distinct system prompts."""
    out = []
    for i in range(n):
        empty = json.dumps(chat_body(""))
        filler = f"system prompt {i}: " + ("lorem ipsum dolor sit amet " * (size // 27 + 1))
        out.append(json.dumps(chat_body(filler[: max(0, size - len(empty))])).encode())
    return out


def chat_body(system: str) -> dict[str, Any]:
    return {
        "model": "bench-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
    }


def upstream_bootstrap(port: int, admin_port: int) -> dict[str, Any]:
    """An Envoy that answers every request itself: the trivial upstream, listening on all of 127/8."""
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
                            "direct_response": {"status": 200, "body": {"inline_string": '{"ok":true}'}},
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
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


def start_upstream(workdir: Path) -> tuple[ManagedProcess, int]:
    from benchmarks.stack import envoy_binary

    port, admin = free_port(), free_port()
    cfg = workdir / "upstream.yaml"
    cfg.write_text(yaml.safe_dump(upstream_bootstrap(port, admin)))
    mp = spawn(
        "upstream",
        [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"],
        workdir,
    )
    wait_http(f"http://127.0.0.1:{admin}/ready", proc=mp.proc)
    return mp, port


def backend_addresses(n: int, port: int) -> list[str]:
    return [f"127.0.0.{i + 1}:{port}" for i in range(n)]


def summarize(low: LoadResult, high: LoadResult) -> dict[str, Any]:
    return {
        "rps": round(high.rps, 1),
        "p50_ms": round(low.percentile(0.50), 3),
        "p99_ms": round(low.percentile(0.99), 3),
        "loaded_p50_ms": round(high.percentile(0.50), 3),
        "loaded_p99_ms": round(high.percentile(0.99), 3),
        "errors": low.errors + high.errors,
        "non_200": sum(v for k, v in {**high.statuses}.items() if k != 200)
        + sum(v for k, v in low.statuses.items() if k != 200),
    }


async def measure(port: int, bodies: list[bytes], seconds: float, concurrency: int) -> dict[str, Any]:
    low = await run_load("127.0.0.1", port, "/v1/chat/completions", bodies, concurrency=1, seconds=seconds, warmup=0.5)
    high = await run_load(
        "127.0.0.1", port, "/v1/chat/completions", bodies, concurrency=concurrency, seconds=seconds, warmup=0.5
    )
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
    path = PickerApp(settings).path
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
    body_mode: str, picker_address: str | None, backends: list[str] | None = None, picker_tls: bool = True
) -> EnvoyOptions:
    return EnvoyOptions(
        listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
        picker_address=picker_address, body_mode=body_mode, backends=tuple(backends or ()),  # type: ignore[arg-type]
        picker_tls=picker_tls,
    )  # fmt: skip


def _through_envoy(workdir: Path, opts: EnvoyOptions, bodies: list[bytes], seconds: float, conc: int) -> dict[str, Any]:
    envoy = start_envoy(opts, workdir)
    try:
        return asyncio.run(measure(opts.listen_port, bodies, seconds, conc))
    finally:
        envoy.stop()


def measure_row(
    workdir: Path,
    addrs: list[str],
    size: int,
    body_mode: str,
    seconds: float,
    conc: int,
    picker_plaintext: bool = False,
) -> dict[str, Any]:
    """Envoy alone, the no-op floor and the picker on the same bodies and backends."""
    bodies = chat_bodies(size)
    row: dict[str, Any] = {"body_bytes": size, "backends": len(addrs), "index_entries": 0, "body_mode": body_mode}
    row["envoy_only"] = _through_envoy(workdir, _envoy_options(body_mode, None, addrs), bodies, seconds, conc)
    # Port 0 and wait for the ready line: traffic must not reach Envoy before the floor listens (Envoy
    # answers 500 while its ext_proc cluster refuses connections), and no port is picked then released.
    argv = [sys.executable, "-m", "benchmarks.noop_extproc", "--port", "0", "--dest", ",".join(addrs)]
    # The floor stays plaintext, the picker speaks TLS (its default, what users run): picker vs floor then
    # includes TLS's cost instead of hiding it (--picker-plaintext measures the picker without it).
    noop, ready = spawn_ready_line("noop-extproc", argv, workdir, "noop-extproc ready")
    try:
        opts = _envoy_options(body_mode, ready.rpartition("extproc=")[2], addrs, picker_tls=False)
        row["floor"] = _through_envoy(workdir, opts, bodies, seconds, conc)
    finally:
        noop.stop()
    cfg = {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "pool": {"backends": [{"name": f"b{i}", "address": a} for i, a in enumerate(addrs)]},
    }
    if picker_plaintext:
        cfg["extproc"] = {"tls": {"mode": "plaintext"}}
    picker = start_picker(cfg, workdir, name="picker")
    try:
        opts = _envoy_options(body_mode, f"127.0.0.1:{picker.extproc_port}", addrs, picker_tls=picker.tls)
        row["picker"] = _through_envoy(workdir, opts, bodies, seconds, conc)
    finally:
        picker.stop()
    row["picker_tls"] = not picker_plaintext
    floor, pick = row["floor"], row["picker"]
    row["throughput_ratio"] = round(pick["rps"] / floor["rps"], 3) if floor["rps"] else None
    row["p50_delta_ms"] = round(pick["p50_ms"] - floor["p50_ms"], 3)
    row["p99_delta_ms"] = round(pick["p99_ms"] - floor["p99_ms"], 3)
    return row


def run(
    out: Path, quick: bool, body_mode: str, seconds: float, concurrency: int, picker_plaintext: bool = False
) -> dict[str, Any]:
    workdir = make_workdir("kv-epp-overhead-")
    upstream, up_port = start_upstream(workdir)
    counts = (2, 128) if quick else BACKEND_COUNTS
    runs = []
    try:
        for n in counts:
            for size in BODY_SIZES:
                row = measure_row(
                    workdir, backend_addresses(n, up_port), size, body_mode, seconds, concurrency, picker_plaintext
                )
                runs.append(row)
                print(format_row(row), flush=True)
    finally:
        upstream.stop()
    results = {
        "params": {
            "seconds": seconds,
            "concurrency": concurrency,
            "body_mode": body_mode,
            "prompts": N_PROMPTS,
            "picker_tls": not picker_plaintext,
        },
        "runs": runs,
        "decision_cpu_us": {
            "body_4k_backends_2": decision_cpu_us(4096, 2),
            "body_220k_backends_128": decision_cpu_us(220 * 1024, 128),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def format_row(r: dict[str, Any]) -> str:
    e, f, p = r["envoy_only"], r["floor"], r["picker"]
    bad = {
        n: r[n]["non_200"] + r[n]["errors"]
        for n in ("envoy_only", "floor", "picker")
        if r[n]["non_200"] + r[n]["errors"]
    }
    warn = f" | FAILED REQUESTS {bad}: figures invalid" if bad else ""
    warn += "" if r.get("picker_tls", True) else " | picker plaintext"
    return (
        f"body={r['body_bytes']:>6} backends={r['backends']:>3} | rps envoy={e['rps']:>7.0f} floor={f['rps']:>7.0f} "
        f"picker={p['rps']:>7.0f} ratio={r['throughput_ratio']} | p50 envoy={e['p50_ms']:.2f} floor={f['p50_ms']:.2f} "
        f"picker={p['p50_ms']:.2f} (+{r['p50_delta_ms']:.2f} ms) | p99 floor={f['p99_ms']:.2f} picker={p['p99_ms']:.2f}"
        + warn
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/overhead"))
    ap.add_argument("--quick", action="store_true", help="2 and 128 backends only, shorter phases")
    ap.add_argument("--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per phase")
    ap.add_argument("--concurrency", type=int, default=16, help="connections in the throughput phase")
    ap.add_argument("--picker-plaintext", action="store_true", help="picker without TLS (default: TLS, as deployed)")
    a = ap.parse_args()
    seconds = a.seconds if a.seconds is not None else (2.0 if a.quick else 4.0)
    res = run(a.out, a.quick, a.body_mode, seconds, a.concurrency, a.picker_plaintext)
    print("decision CPU (parse + key + pick), median:", json.dumps(res["decision_cpu_us"]))
    print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
