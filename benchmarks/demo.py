"""`make demo`: round robin vs cache-aware routing on S1-like traffic, in about a minute.

    python -m benchmarks.demo [--out out/demo] [--time-scale 0.5]

Two simulated vLLM replicas behind the real Envoy: first Envoy's own round robin (no picker), then the
picker's PrefixAwareHash (Tier 1, the seed's load bound epsilon 0.25), then the cost model (``kv_cost``,
Tier 4, the documented default: the kv-listener follows the engines' KV events and the picker sends each
request where its estimated time to first token is least: cached prefix, queued prefill, load), each on
cold caches with the same prefix-repetition trace (64 prefixes of 3072 tokens, 3 uses each, 10 req/s,
concurrency 32).
Prints the results table and a headline per cache-aware policy on what users feel: TTFT from the scheduled
arrival (p50, p99: a request waiting for a client slot counts), latency p50, throughput and the engines'
hit rate, against round robin. Writes results.json, results.md and plots into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.policies import POLICIES
from benchmarks.report import markdown_table
from benchmarks.routing import run
from benchmarks.scenarios import demo

DISPLAY = {"round_robin": "round robin"}
POLICY_NAMES = ("round_robin", "prefix_hash", "kv_cost")
HEADLINE_POLICY = "kv_cost"


def _change(before: float | None, after: float | None, unit: str = " ms") -> str:
    if before is None or after is None:
        return "—"
    pct = f" ({100 * (after - before) / before:+.0f}%)" if before else ""
    return f"{before:.0f} -> {after:.0f}{unit}{pct}"


def gains(doc: dict[str, Any], baseline: str = "round_robin") -> list[str]:
    """One line per cache-aware policy against the baseline, on what users feel: TTFT from arrival p50 and
    p99 (the client's queue included), TTFT from send p50 and p99 (as vLLM's benchmark measures it), latency
    p50, throughput, then the hit rate that explains them. The headline policy comes first."""
    base = doc["policies"].get(baseline)
    if not base or not base.get("available"):
        return []
    names = sorted((n for n in doc["policies"] if n != baseline), key=lambda n: n != HEADLINE_POLICY)
    lines = []
    for name in names:
        p = doc["policies"][name]
        label = f"{DISPLAY.get(name, name)} vs {DISPLAY.get(baseline, baseline)}"
        if not p.get("available"):
            lines.append(f"{label}: {p.get('reason', 'not available')}")
            continue
        ba, pa = base["ttft_from_arrival_ms"], p["ttft_from_arrival_ms"]
        bs, ps = base["ttft_ms"], p["ttft_ms"]
        parts = [
            f"TTFT from arrival p50 {_change(ba['p50'], pa['p50'])}",
            f"p99 {_change(ba['p99'], pa['p99'])}",
            f"TTFT from send p50 {_change(bs['p50'], ps['p50'])}",
            f"p99 {_change(bs['p99'], ps['p99'])}",
            f"latency p50 {_change(base['latency_ms']['p50'], p['latency_ms']['p50'])}",
        ]
        if base["achieved_rate"]:
            ratio = p["achieved_rate"] / base["achieved_rate"]
            parts.append(f"throughput {base['achieved_rate']:.2f} -> {p['achieved_rate']:.2f} req/s (x{ratio:.2f})")
        parts.append(f"hit rate {100 * (base['hit_rate'] or 0):.1f}% -> {100 * (p['hit_rate'] or 0):.1f}%")
        lines.append(f"{label}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/demo"))
    ap.add_argument("--time-scale", type=float, default=0.5, help="real s per simulated s")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = list(POLICY_NAMES)
    scenario = demo(a.time_scale)
    print(
        f"kv-epp demo: {len(scenario.records)} requests, 2 simulated replicas, real Envoy; policies: {', '.join(names)}"
    )
    started = time.perf_counter()
    doc = run(scenario, [POLICIES[n] for n in names], a.out)
    print()
    print(markdown_table(doc))
    print()
    for line in gains(doc):
        print(line)
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {a.out}/results.json, results.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
