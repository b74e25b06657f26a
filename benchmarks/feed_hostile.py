"""Hostile feed subscribers: N subscribers that connect and never read, against a listener whose backend
holds many keys. Prints the listener's RSS growth (while connected and after they left) and /healthz
latency (max, p50) throughout, plus how many subscriptions the listener accepted.

    python -m benchmarks.feed_hostile [--subscribers 300] [--keys 100000] [--transport sse|grpc]
                                      [--hold-seconds 15] [--cap 64] [--out DIR]

The listener runs as a real ``kv-listener`` process fed by the engine simulator's ZMQ publisher (vLLM wire
format). SSE subscribers are raw sockets with a small receive buffer that send the GET and never read;
gRPC subscribers open ``Subscribe`` streams and never call ``read()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from benchmarks.engine_sim.kv_events import BlockStoredEvent, KvEventPublisher, KvEventsSettings
from benchmarks.stack import ListenerProcess, free_port, make_workdir, start_listener
from picker.shared.feed_records import GRPC_SUBSCRIBE
from picker.shared.kvfeed_pb import feed_pb2 as pb

BLOCK = 16
CHAIN = 100  # blocks per stored chain


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def fill(pub: KvEventPublisher, keys: int) -> None:
    """Store ``keys`` blocks as chains of CHAIN blocks (one BlockStored per chain)."""
    for c in range((keys + CHAIN - 1) // CHAIN):
        n = min(CHAIN, keys - c * CHAIN)
        digests = tuple(hashlib.sha256(f"{c}/{i}".encode()).digest() for i in range(n))
        tokens = tuple(range(c * 1_000_000, c * 1_000_000 + n * BLOCK))
        await pub.publish([BlockStoredEvent(digests, None, tokens, BLOCK)])
        if c % 50 == 0:
            await asyncio.sleep(0)


async def healthz(session: aiohttp.ClientSession, url: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    async with session.get(url) as resp:
        body = await resp.json()
    return time.perf_counter() - t0, body


async def sse_subscriber(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    s.send(b"GET /events/e1 HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = make_workdir("kv-feed-hostile-")
    pub = KvEventPublisher(KvEventsSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint=None))
    await pub.start()
    grpc_port = free_port()
    cfg: dict[str, Any] = {
        "key_block_size": BLOCK,
        "limits": {"max_tracked_blocks": max(args.keys * 2, 1000)},
        "grpc": {"listen": f"127.0.0.1:{grpc_port}"},
        "feed": {"max_subscribers_per_backend": args.cap, "max_subscribers": max(args.cap, 256)},
        "sources": [{"backend_name": "e1", "engine": "vllm", "model": "m", "zmq_endpoint": pub.endpoint}],
    }
    if args.old:
        del cfg["grpc"], cfg["feed"]
    listener: ListenerProcess = await asyncio.to_thread(start_listener, cfg, workdir)
    pid = listener.process.proc.pid
    url = f"{listener.url}/healthz"
    sockets: list[socket.socket] = []
    calls: list[Any] = []
    # no BDP probing: a 64 KiB HTTP/2 window, so unread streams push back on the listener (the hostile case)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.http2.bdp_probe", 0)])
    result: dict[str, Any] = {
        "subscribers": args.subscribers,
        "keys": args.keys,
        "transport": args.transport,
        "cap": None if args.old else args.cap,
    }
    try:
        async with aiohttp.ClientSession() as session:
            while True:  # the ZMQ subscription settles before the first batch is kept
                await pub.publish([BlockStoredEvent((b"\x01" * 32,), None, tuple(range(BLOCK)), BLOCK)])
                _, body = await healthz(session, url)
                if body["sources"]["e1"]["tracked_blocks"] >= 1:
                    break
                await asyncio.sleep(0.2)
            await fill(pub, args.keys)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _, body = await healthz(session, url)
                if body["sources"]["e1"]["tracked_blocks"] >= args.keys:
                    break
                await asyncio.sleep(0.2)
            result["tracked_blocks"] = body["sources"]["e1"]["tracked_blocks"]
            rss0 = rss_bytes(pid)
            lat: list[float] = []
            peak = rss0
            subscribe = channel.unary_stream(
                GRPC_SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString, response_deserializer=bytes
            )
            t_open = time.monotonic()
            for _ in range(args.subscribers):
                if args.transport == "sse":
                    sockets.append(await sse_subscriber(listener.port))
                else:
                    calls.append(subscribe(pb.SubscribeRequest(backend="e1")))
            end = t_open + args.hold_seconds
            accepted = 0
            while time.monotonic() < end:
                dt, body = await healthz(session, url)
                lat.append(dt)
                accepted = max(accepted, int(body["sources"]["e1"]["subscribers"]))
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.05)
            for s in sockets:
                s.close()
            for c in calls:
                c.cancel()
            sockets, calls = [], []
            after_end = time.monotonic() + 5
            while time.monotonic() < after_end:
                dt, body = await healthz(session, url)
                lat.append(dt)
                await asyncio.sleep(0.1)
            rss_after = rss_bytes(pid)
            result.update(
                accepted_max=accepted,
                subscribers_left=int(body["sources"]["e1"]["subscribers"]),
                rss_before_mib=round(rss0 / 2**20, 1),
                rss_peak_growth_mib=round((peak - rss0) / 2**20, 1),
                rss_growth_after_mib=round((rss_after - rss0) / 2**20, 1),
                healthz_max_ms=round(max(lat) * 1000, 1),
                healthz_p50_ms=round(statistics.median(lat) * 1000, 1),
                healthz_samples=len(lat),
            )
    finally:
        for s in sockets:
            s.close()
        for c in calls:
            c.cancel()
        await channel.close()
        await asyncio.to_thread(listener.stop)
        await pub.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subscribers", type=int, default=300)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--transport", choices=["sse", "grpc"], default="sse")
    ap.add_argument("--hold-seconds", type=float, default=15.0)
    ap.add_argument("--cap", type=int, default=64, help="the listener's feed.max_subscribers_per_backend")
    ap.add_argument("--old", action="store_true", help="a listener without the grpc/feed caps keys (before)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (args.out / f"results-{args.transport}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
