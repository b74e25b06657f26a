"""`make demo`: round robin vs cache-aware routing on S1-like traffic, in well under two minutes.

    python -m benchmarks.demo [--out out/demo] [--time-scale 0.5]

Two simulated vLLM replicas behind the real Envoy: first Envoy's own round robin (no picker), then the
picker's PrefixAwareHash (Tier 1, the seed's load bound epsilon 0.25), then the KV-aware policy (Tier 4:
the kv-listener follows the engines' KV events, the picker routes to the replica holding the prompt),
each on cold caches with the same prefix-repetition trace (64 prefixes of 3072 tokens, 3 uses each,
10 req/s, concurrency 32).
Prints the results table and what the cache-aware routing gained; writes results.json, results.md and
plots into ``--out``.
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


def gains(doc: dict[str, Any], baseline: str = "round_robin") -> list[str]:
    """One line per cache-aware policy: hit rate, TTFT and throughput against the baseline."""
    base = doc["policies"].get(baseline)
    if not base or not base.get("available"):
        return []
    lines = []
    for name, p in doc["policies"].items():
        if name == baseline or not p.get("available"):
            continue
        parts = [f"hit rate {100 * (base['hit_rate'] or 0):.1f}% -> {100 * (p['hit_rate'] or 0):.1f}%"]
        for q in ("p50", "p99"):
            b, c = base["ttft_ms"][q], p["ttft_ms"][q]
            if b and c:
                parts.append(f"TTFT {q} {b:.0f} -> {c:.0f} ms ({100 * (c - b) / b:+.0f}%)")
        if base["achieved_rate"]:
            ratio = p["achieved_rate"] / base["achieved_rate"]
            tok = p["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
            parts.append(
                f"throughput {base['achieved_rate']:.2f} -> {p['achieved_rate']:.2f} req/s (x{ratio:.2f}), "
                f"tokens/s x{tok:.2f}"
            )
        lines.append(f"{name} vs {baseline}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/demo"))
    ap.add_argument("--time-scale", type=float, default=0.5, help="real s per simulated s")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = ["round_robin", "prefix_hash", "kv_aware"]
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
