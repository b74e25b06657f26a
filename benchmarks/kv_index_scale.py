"""Picker-side Tier 4 at scale: memory and lookup/score time of the KV index at 100k and 1M entries.

    python -m benchmarks.kv_index_scale [--entries 1000000] [--backends 8] [--out DIR]

Fills an ``InMemoryKvIndex`` the way the feed does (chains of block keys from ``picker.shared.block_keys``,
each chain held by one or two backends), then measures: bytes per entry (tracemalloc), process RSS,
and the median time of ``lookup`` and of ``lookup`` + ``KvOverlapScorer.score`` for a 64-block (1k-token) and a
1024-block (16k-token) request whose prefix is held, and for a miss. Prints JSON; writes it too.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from picker.api import Endpoint, EndpointState, InMemoryKvIndex, KvOverlapScorer, PoolView, Settings
from picker.shared.block_keys import request_block_keys
from picker.shared.tiers import StorageTier

BLOCK = 16
CHAIN_BLOCKS = 64  # each stored prompt: 1,024 tokens


def _median_us(fn: Any, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e6, 2)


def fill(index: InMemoryKvIndex, entries: int, backends: list[str], rng: random.Random) -> list[list[int]]:
    """Store chains until ``entries`` block keys exist; returns a sample of them (1 in 1000, so the
    benchmark's own references barely count in the measured memory)."""
    chains: list[list[int]] = []
    n = 0
    i = 0
    while n < entries:
        tokens = [rng.randrange(32_000) for _ in range(CHAIN_BLOCKS * BLOCK)]
        keys = request_block_keys(tokens, BLOCK, "bench-model")
        holders = rng.sample(backends, 2 if i % 4 == 0 else 1)
        for b in holders:
            index.put(b, keys, StorageTier.GPU_HOT)
        if i % 1000 == 0:
            chains.append(keys)
        n += len(keys)
        i += 1
    return chains


def measure(entries: int, n_backends: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    backends = [f"b{i}" for i in range(n_backends)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = InMemoryKvIndex(max_entries=2 * entries, ttl_seconds=86_400)
    chains = fill(index, entries, backends, rng)
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    scorer = KvOverlapScorer(Settings().kv_cache_index.scoring, BLOCK)
    view = PoolView(
        tuple(EndpointState(Endpoint(b, f"10.0.0.{i}:8000"), in_flight=i % 3) for i, b in enumerate(backends))
    )
    hit64 = chains[len(chains) // 2]
    # a 1024-block request: 16 stored chains are independent, so take one chain's keys then a long tail
    hit1024 = hit64 + request_block_keys([rng.randrange(32_000) for _ in range(960 * BLOCK)], BLOCK, "other")
    miss = request_block_keys([rng.randrange(32_000) for _ in range(CHAIN_BLOCKS * BLOCK)], BLOCK, "bench-model")
    reps = 2000
    return {
        "entries": index.entry_count,
        "block_keys": index.prefix_count,
        "backends": n_backends,
        "index_bytes": index_bytes,
        "bytes_per_block_key": round(index_bytes / max(1, index.prefix_count), 1),
        "bytes_per_entry": round(index_bytes / max(1, index.entry_count), 1),
        "rss_max_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "lookup_us": {
            "hit_64_blocks": _median_us(lambda: index.lookup(hit64), reps),
            "hit_64_then_miss_1024_blocks": _median_us(lambda: index.lookup(hit1024), reps),
            "miss": _median_us(lambda: index.lookup(miss), reps),
        },
        "score_us": {
            "hit_64_blocks": _median_us(lambda: scorer.score(index.lookup(hit64), view), reps),
            "miss": _median_us(lambda: scorer.score(index.lookup(miss), view), reps),
        },
        "hit_64_result": {k: v.blocks for k, v in index.lookup(hit64).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("out/kv_index_scale"))
    a = ap.parse_args()
    results = [measure(n, a.backends) for n in a.entries]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
