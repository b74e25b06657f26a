"""Hostile or careless publishers against a real ``kv-listener`` process: the listener's RSS and /healthz
latency while it receives decoder bombs, huge removals and events at the hash cap, and whether a quiet
backend keeps its blocks while a busy one floods its own.

    python -m benchmarks.publisher_hostile [--rounds 3] [--busy-blocks 300000] [--out DIR]

Two sources: ``quiet`` (one chain of 64 blocks, then silence) and ``hostile``. The hostile publisher (a
ZMQ PUB bound here, the listener connects) sends, per round: a 7.9 MiB msgpack bomb of tiny containers
(inside ``limits.max_message_bytes``), one BlockRemoved of 1,000,000 hashes, one BlockStored at the
``max_event_hashes`` cap (page size 1), then ``--busy-blocks`` ordinary 16-token blocks. Meanwhile /healthz
is polled every 10 ms. Prints JSON: /healthz max and p99 latency, the listener's peak and final RSS
(VmHWM, VmRSS), the quiet source's tracked blocks at the end, and the hostile source's drop counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq as _zmq
import zmq.asyncio

from benchmarks.listener_hostile import _bomb
from benchmarks.stack import free_port, make_workdir, start_listener

BLOCK = 16
Z: Any = _zmq  # pyzmq is not type-checked (follow_imports=skip)


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Pub:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(Z.PUB)
        self.sock.setsockopt(Z.LINGER, 0)
        self.sock.setsockopt(Z.SNDHWM, 100_000)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    async def send(self, events: list[Any]) -> None:
        await self.send_raw(msgpack.packb([time.time(), events, 0]))

    async def send_raw(self, payload: bytes) -> None:
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


def stored(chain: int, n: int, page: int = BLOCK) -> dict[str, Any]:
    hashes = [int.from_bytes(hashlib.sha256(f"{chain}/{i}".encode()).digest()[:8], "big") for i in range(n)]
    tokens = [(chain * 7919 + i) % 50_000 for i in range(n * page)]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": page, "medium": "GPU"}  # fmt: skip


def poll_health(url: str, stop: Any, out: Any) -> None:
    """In its own process (the publisher's packing must not delay the probe): GET /healthz every 10 ms."""
    samples = []
    while not stop.is_set():
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as resp:
            resp.read()
        samples.append(time.perf_counter() - t0)
        time.sleep(0.01)
    out.put(samples)


async def run(rounds: int, busy_blocks: int) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    quiet, hostile = Pub(ctx), Pub(ctx)
    workdir = make_workdir("kv-epp-publisher-hostile-")
    cfg = {
        "listen": f"127.0.0.1:{free_port()}",
        "limits": {"max_tracked_blocks": 200_000},
        "sources": [
            {"backend_name": "quiet", "model": "m", "zmq_endpoint": f"tcp://127.0.0.1:{quiet.port}"},
            {"backend_name": "hostile", "engine": "sglang", "model": "m",
             "zmq_endpoint": f"tcp://127.0.0.1:{hostile.port}"},
        ],
    }  # fmt: skip
    listener = start_listener(cfg, workdir)
    pid = listener.process.proc.pid
    samples: list[float] = []
    mp = multiprocessing.get_context("spawn")
    stop, out = mp.Event(), mp.Queue()
    poller = mp.Process(target=poll_health, args=(listener.url + "/healthz", stop, out), daemon=True)
    try:
        async with aiohttp.ClientSession() as session:

            async def health() -> dict[str, Any]:
                async with session.get(listener.url + "/healthz") as r:
                    return dict(await r.json())

            async def connected() -> bool:
                srcs = (await health())["sources"]
                return all(s.get("connected") for s in srcs.values())

            for _ in range(500):
                if await connected():
                    break
                await asyncio.sleep(0.02)
            await quiet.send([stored(0, 64)])
            rss_before = proc_status(pid, "VmRSS")
            poller.start()
            cap = 262_144
            for r in range(rounds):
                await hostile.send_raw(_bomb(int(7.9 * (1 << 20))))
                await hostile.send([{"type": "BlockRemoved", "block_hashes": list(range(1, 1_000_001))}])
                await hostile.send([stored(1_000 + r, cap, page=1)])
                for c in range(busy_blocks // 100):
                    await hostile.send([stored(10_000 + r * 100_000 + c, 100)])
                    if c % 20 == 0:
                        await asyncio.sleep(0)
            await asyncio.sleep(3.0)  # let the listener finish applying what is queued
            stop.set()
            samples = out.get(timeout=30)
            poller.join(timeout=10)
            final = await health()
    finally:
        stop.set()
        if poller.is_alive():
            poller.terminate()
            poller.join(timeout=5)
        peak = proc_status(pid, "VmHWM")
        now = proc_status(pid, "VmRSS")
        metrics = ""
        with contextlib.suppress(Exception), urllib.request.urlopen(listener.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        listener.stop()
        quiet.sock.close()
        hostile.sock.close()
        ctx.term()
    drops = {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kv_listener_events_dropped_total{") and 'source="hostile"' in line
    }
    ms = sorted(s * 1000 for s in samples)
    return {
        "rounds": rounds,
        "healthz_samples": len(ms),
        "healthz_max_ms": round(ms[-1], 1) if ms else None,
        "healthz_p99_ms": round(ms[int(len(ms) * 0.99) - 1], 1) if ms else None,
        "healthz_median_ms": round(statistics.median(ms), 2) if ms else None,
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_final_mib": round(now / 2**20, 1),
        "quiet_tracked_blocks": final["sources"]["quiet"].get("tracked_blocks"),
        "hostile_tracked_blocks": final["sources"]["hostile"].get("tracked_blocks"),
        "hostile_dropped": drops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-blocks", type=int, default=300_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = asyncio.run(run(args.rounds, args.busy_blocks))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(text)


if __name__ == "__main__":
    main()
