"""Engines' ZMQ sides for the listener's tests, as real sockets on loopback in the test process: a publisher
(``Pub``: an XPUB, whose subscription message tells the test the listener is connected, so no sleeps are needed),
a replay ROUTER in any reply layout (``ReplayServer``), and a vLLM-like engine with both that can restart on the
same ports (``Engine``); with builders of what such an engine publishes (``stored``, ``removed``, ``workload``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from tests.support.poll import async_wait_until

END = b"\xff" * 8
PAGE = 16  # the page size of what ``Engine``'s helpers publish (the feed's default key block size)


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def tokens(tag: int, n_blocks: int) -> list[int]:
    return [tag * 100_000 + i for i in range(n_blocks * PAGE)]


def stored(hashes: list[int], parent: int | None, toks: list[int]) -> list[Any]:
    return ["BlockStored", hashes, parent, toks, PAGE, None, "GPU", None]


def removed(hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


def workload(n: int, seed: int, tag: int) -> list[list[Any]]:
    """Batches of stores (roots and extensions), ancestor removals (the child stays keyed), whole-chain
    removals and a second copy of a hash (two copies need two removals)."""
    rng = random.Random(seed)
    batches: list[list[Any]] = []
    chains: list[tuple[list[int], list[int]]] = []  # (hashes, tokens)
    next_hash = tag * 1_000_000
    for i in range(n):
        r = rng.random()
        if chains and r < 0.2:
            hashes, _ = chains[rng.randrange(len(chains))]
            batches.append([removed(hashes[:1])])  # an ancestor goes, its children stay keyed
        elif chains and r < 0.3:
            hashes, _ = chains.pop(rng.randrange(len(chains)))
            batches.append([removed(hashes)])
        elif chains and r < 0.35:
            hashes, toks = chains[-1]
            batches.append([stored(hashes[:1], None, toks[:PAGE])])  # a second copy of a stored hash
        else:
            ext = chains[-1] if chains and r < 0.6 else None
            toks = tokens(tag * 1000 + i, 3)
            hashes = [next_hash + k for k in range(3)]
            next_hash += 3
            if ext is not None:
                batches.append([stored(hashes, ext[0][-1], toks)])
                chains.append((hashes, ext[1] + toks))
            else:
                batches.append([stored(hashes, None, toks)])
                chains.append((hashes, toks))
    return batches


class Pub:
    """An engine's publisher. ``send`` takes the seq the test names; ``send_events`` and ``send_raw`` number the
    messages themselves (``seq`` is the next one)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.seq = 0

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            msg = await self.sock.recv()
        assert msg[:1] == b"\x01"

    async def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        await self.sock.send_multipart([topic, seq8(seq), payload])

    async def send_events(self, *events: Any) -> None:
        await self.send_raw(msgpack.packb([0.0, list(events), 0]))

    async def send_raw(self, payload: bytes) -> None:
        await self.sock.send_multipart([b"", seq8(self.seq), payload])
        self.seq += 1


class ReplayServer:
    """A ROUTER answering replay requests from a dict of seq → payload, in a chosen reply layout."""

    LAYOUTS = ("seq_payload", "topic_seq_payload", "nodelim_seq_payload", "nodelim_topic_seq_payload")

    def __init__(self, ctx: zmq.asyncio.Context, layout: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.layout = layout
        self.buffer: dict[int, bytes] = {}
        self.requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    def _frames(self, ident: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        return {
            "seq_payload": [ident, b"", seq, payload],
            "topic_seq_payload": [ident, b"", b"kv", seq, payload],
            "nodelim_seq_payload": [ident, seq, payload],
            "nodelim_topic_seq_payload": [ident, b"kv", seq, payload],
        }[self.layout]

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            self.requests.append(start)
            for s in sorted(self.buffer):
                if s >= start:
                    await self.sock.send_multipart(self._frames(ident, seq8(s), self.buffer[s]))
            await self.sock.send_multipart(self._frames(ident, END, b""))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(linger=0)


class Engine:
    """A vLLM-like publisher: XPUB (verbose: every subscription is seen) + replay ROUTER over a buffer of
    every batch of the current incarnation; ``close`` then ``open_replay`` / ``open_pub`` restart it on the
    same ports (the test resets ``seq`` and ``buffer``)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.seq = 0
        self.buffer: dict[int, bytes] = {}
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.pub_port = 0
        self.replay_port = 0
        self.router = self._bind(zmq.ROUTER, 0)
        self.task = asyncio.create_task(self._serve(self.router))
        self.pub = self._bind(zmq.XPUB, 0)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def _bind(self, kind: int, port: int) -> Any:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            if not port:
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                if kind == zmq.XPUB:
                    self.pub_port = port
                else:
                    self.replay_port = port
            else:
                sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError:  # the closed socket's port is released by libzmq's I/O thread, soon
            sock.close(linger=0)
            return None
        return sock

    async def open_pub(self) -> None:
        """Bind the PUB again on its port (a restarted engine)."""
        self.pub = await async_wait_until(lambda: self._bind(zmq.XPUB, self.pub_port), what="the PUB port")

    async def open_replay(self) -> None:
        """Bind the replay ROUTER again on its port (a restarted engine)."""
        router = await async_wait_until(lambda: self._bind(zmq.ROUTER, self.replay_port), what="the replay port")
        self.router = router
        self.task = asyncio.create_task(self._serve(router))

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            for s in sorted(self.buffer):
                if s >= start:
                    await router.send_multipart([ident, b"", seq8(s), self.buffer[s]])
            await router.send_multipart([ident, b"", END, b""])

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        for s in (self.pub, self.router):
            if s is not None:
                s.close(linger=0)
        self.pub = self.router = None

    async def subscribed(self, n: int = 1) -> None:
        assert self.pub is not None
        for _ in range(n):
            async with asyncio.timeout(20):
                msg = await self.pub.recv()
            assert msg[:1] == b"\x01"

    async def publish(self, events: list[Any]) -> int:
        seq = self.seq
        self.seq += 1
        payload = msgpack.packb([float(seq), events, 0])
        self.buffer[seq] = payload
        if self.pub is not None:
            await self.pub.send_multipart([b"", seq8(seq), payload])
        return seq
