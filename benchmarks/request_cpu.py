"""Where the picker's per-request CPU goes, beside the no-op floor's.

    python -m benchmarks.request_cpu [--body BYTES] [--requests N] [--profile] [--live SECONDS]

In process (no gRPC, no Envoy): each servicer's ``Process()`` is driven with the six messages Envoy
sends per full-duplex request (headers; the body chunk and an empty end-of-stream chunk; response
headers; a response chunk and an empty end-of-stream chunk) and CPU time per request is printed for the
no-op floor and the picker (PrefixAwareHash, 2 backends). ``--profile`` adds the picker's top functions
by own time (cProfile, GC off so collections are not charged to whatever ran). ``--live`` runs both
through the real Envoy at 16 connections and prints each ext_proc process's CPU per request and
Envoy's, read from /proc: the figure the overhead ratio depends on.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from benchmarks.httpload import run_load
from benchmarks.noop_extproc import READY_PREFIX, NoopProcessor
from benchmarks.overhead import backend_addresses, chat_bodies, start_upstream
from benchmarks.stack import make_workdir, spawn_ready_line, start_envoy, start_picker
from picker.api import EnvoyOptions, ExternalProcessor, build_app, parse_settings

ENVOY_HEADERS = (
    (":authority", "127.0.0.1"), (":path", "/v1/chat/completions"), (":method", "POST"), (":scheme", "http"),
    ("content-type", "application/json"), ("x-forwarded-proto", "http"),
    ("x-request-id", "0b1c2d3e-aaaa-bbbb-cccc-0123456789ab"),
)  # fmt: skip


def envoy_messages(body: bytes) -> list[bytes]:
    """The serialized messages Envoy sends for one full-duplex request with a 200 JSON answer."""

    def headers(pairs: tuple[tuple[str, str], ...], eos: bool = False) -> pb.HttpHeaders:
        hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=eos)

    msgs = [
        pb.ProcessingRequest(request_headers=headers((*ENVOY_HEADERS, ("content-length", str(len(body)))))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
        pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)),
        pb.ProcessingRequest(response_headers=headers(((":status", "200"), ("content-length", "11")))),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"ok":true}')),
        pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)),
    ]
    return [m.SerializeToString() for m in msgs]


def picker_settings(addresses: list[str]) -> dict[str, Any]:
    return {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "pool": {"backends": [{"name": f"b{i}", "address": a} for i, a in enumerate(addresses)]},
    }


def servicers() -> dict[str, Any]:
    addrs = backend_addresses(2, 8000)
    app = build_app(parse_settings(picker_settings(addrs)))
    return {
        "floor": NoopProcessor(addrs),
        "picker": ExternalProcessor(app.path, app.metrics, app.settings.extproc, app.sampling),
    }


async def _messages(raw: list[bytes]) -> AsyncIterator[pb.ProcessingRequest]:
    for m in raw:
        yield pb.ProcessingRequest.FromString(m)


class _Context:
    """What the servicer asks of gRPC's context on every stream: the peer's address (its per-peer stream cap)."""

    @staticmethod
    def peer() -> str:
        return "ipv4:127.0.0.1:50000"


async def _drive(servicer: Any, requests: list[list[bytes]], n: int) -> None:
    context = _Context()
    for i in range(n):
        async for r in servicer.Process(_messages(requests[i % len(requests)]), context):
            r.SerializeToString()


def cpu_us_per_request(servicer: Any, requests: list[list[bytes]], n: int) -> float:
    asyncio.run(_drive(servicer, requests, min(n, 500)))  # warm up
    t0 = time.process_time()
    asyncio.run(_drive(servicer, requests, n))
    return (time.process_time() - t0) / n * 1e6


def profile(servicer: Any, requests: list[list[bytes]], n: int, top: int = 25) -> str:
    prof = cProfile.Profile()
    gc.disable()
    try:
        prof.runcall(asyncio.run, _drive(servicer, requests, n))
    finally:
        gc.enable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live(seconds: float, body_bytes: int) -> list[str]:
    """Both ext_proc servers through the real Envoy: CPU per request of each process and of Envoy."""
    workdir = make_workdir("kv-epp-request-cpu-")
    upstream, port = start_upstream(workdir)
    addrs = backend_addresses(2, port)
    bodies = chat_bodies(body_bytes)
    lines = []
    try:
        for kind in ("floor", "picker"):
            stop: Callable[[], object]
            if kind == "floor":
                argv = [sys.executable, "-m", "benchmarks.noop_extproc", "--dest", ",".join(addrs)]
                mp, line = spawn_ready_line("noop-extproc", argv, workdir, READY_PREFIX)
                pid, xport, stop = mp.proc.pid, int(line.rsplit(":", 1)[1]), mp.stop
            else:
                picker = start_picker(picker_settings(addrs), workdir)
                pid, xport, stop = picker.process.proc.pid, picker.extproc_port, picker.stop
            from benchmarks.stack import free_port

            opts = EnvoyOptions(
                listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                picker_address=f"127.0.0.1:{xport}", backends=tuple(addrs),
                picker_tls=kind == "picker",  # the no-op floor is plaintext; the picker speaks TLS by default
            )  # fmt: skip
            envoy = start_envoy(opts, workdir)
            try:
                url = ("127.0.0.1", opts.listen_port, "/v1/chat/completions")
                asyncio.run(run_load(*url, bodies, concurrency=16, seconds=1.0, warmup=0.5))
                c0, e0 = _proc_cpu_seconds(pid), _proc_cpu_seconds(envoy.process.proc.pid)
                r = asyncio.run(run_load(*url, bodies, concurrency=16, seconds=seconds, warmup=0.0))
                c1, e1 = _proc_cpu_seconds(pid), _proc_cpu_seconds(envoy.process.proc.pid)
                n = max(1, sum(r.statuses.values()))
                lines.append(
                    f"{kind}: {r.rps:.0f} req/s, ext_proc CPU {(c1 - c0) / n * 1e6:.0f} us/request, "
                    f"Envoy CPU {(e1 - e0) / n * 1e6:.0f} us/request ({n} requests, {r.errors} errors)"
                )
            finally:
                envoy.stop()
                stop()
    finally:
        upstream.stop()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--body", type=int, default=4096, help="request body bytes (default 4096)")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--profile", action="store_true", help="the picker's top functions by own time")
    ap.add_argument("--live", type=float, default=0.0, metavar="SECONDS", help="also measure through the real Envoy")
    a = ap.parse_args()
    requests = [envoy_messages(b) for b in chat_bodies(a.body)]
    for name, servicer in servicers().items():
        us = cpu_us_per_request(servicer, requests, a.requests)
        print(f"in process, {name}: {us:.1f} us CPU per request ({a.body}-byte body)", flush=True)
    if a.profile:
        print(profile(servicers()["picker"], requests, a.requests))
    if a.live:
        for line in live(a.live, a.body):
            print("through Envoy, " + line, flush=True)


if __name__ == "__main__":
    main()
