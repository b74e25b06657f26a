"""What TLS on the ext_proc port costs: the picker through the real Envoy with TLS (its default) and with
``extproc.tls.mode: plaintext``, in interleaved pairs (the order alternates) so drift on a shared machine
hits both alike.

    python -m benchmarks.tls_cost [--pairs 6] [--seconds 4] [--body 4096] [--backends 2]

Per run: requests/s at 16 connections, and CPU per request of the picker process and of Envoy (from
/proc, so a busy neighbour inflates neither). Prints every run and the medians; no file is written.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

from benchmarks.httpload import run_load
from benchmarks.overhead import _envoy_options, backend_addresses, chat_bodies, start_upstream
from benchmarks.request_cpu import _proc_cpu_seconds
from benchmarks.stack import make_workdir, start_envoy, start_picker

MODES = ("tls", "plaintext")


def one_run(
    workdir: Path, addrs: list[str], bodies: list[bytes], mode: str, seconds: float, name: str
) -> dict[str, float]:
    cfg: dict[str, Any] = {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "pool": {"backends": [{"name": f"b{j}", "address": a} for j, a in enumerate(addrs)]},
    }
    if mode == "plaintext":
        cfg["extproc"] = {"tls": {"mode": "plaintext"}}
    picker = start_picker(cfg, workdir, name=name)
    try:
        opts = _envoy_options("FULL_DUPLEX_STREAMED", f"127.0.0.1:{picker.extproc_port}", addrs, picker.tls)
        envoy = start_envoy(opts, workdir)
        try:
            url = ("127.0.0.1", opts.listen_port, "/v1/chat/completions")
            asyncio.run(run_load(*url, bodies, concurrency=16, seconds=1.0, warmup=0.5))
            pp, ep = picker.process.proc.pid, envoy.process.proc.pid
            c0, e0 = _proc_cpu_seconds(pp), _proc_cpu_seconds(ep)
            r = asyncio.run(run_load(*url, bodies, concurrency=16, seconds=seconds, warmup=0.0))
            c1, e1 = _proc_cpu_seconds(pp), _proc_cpu_seconds(ep)
        finally:
            envoy.stop()
    finally:
        picker.stop()
    n = max(1, sum(r.statuses.values()))
    return {
        "rps": r.rps,
        "picker_us": (c1 - c0) / n * 1e6,
        "envoy_us": (e1 - e0) / n * 1e6,
        "failed": float(n - r.statuses.get(200, 0) + r.errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--body", type=int, default=4096)
    ap.add_argument("--backends", type=int, default=2)
    a = ap.parse_args()
    workdir = make_workdir("kv-epp-tls-cost-")
    upstream, port = start_upstream(workdir)
    addrs = backend_addresses(a.backends, port)
    bodies = chat_bodies(a.body)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for i in range(a.pairs):
            for mode in MODES if i % 2 == 0 else tuple(reversed(MODES)):
                r = one_run(workdir, addrs, bodies, mode, a.seconds, f"picker-{mode}-{i}")
                runs[mode].append(r)
                print(
                    f"pair {i} {mode:9} {r['rps']:6.0f} req/s  picker {r['picker_us']:5.0f} us/req  "
                    f"envoy {r['envoy_us']:5.0f} us/req  failed {r['failed']:.0f}",
                    flush=True,
                )
    finally:
        upstream.stop()
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("rps", "picker_us", "envoy_us")} for m in MODES}
    for m in MODES:
        print(f"median {m:9} {med[m]['rps']:6.0f} req/s  picker {med[m]['picker_us']:5.0f} us/req  "
              f"envoy {med[m]['envoy_us']:5.0f} us/req")  # fmt: skip
    t, p = med["tls"], med["plaintext"]
    print(
        f"TLS vs plaintext: throughput {100 * (t['rps'] / p['rps'] - 1):+.1f}%, picker CPU "
        f"{t['picker_us'] - p['picker_us']:+.0f} us/req, Envoy CPU {t['envoy_us'] - p['envoy_us']:+.0f} us/req"
    )


if __name__ == "__main__":
    main()
