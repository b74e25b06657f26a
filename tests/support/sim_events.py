"""A tap on the engine simulator's KV events: a SUB socket on its PUB (joined past ZMQ's slow-joiner window) and a
DEALER on its replay ROUTER, the simulator started with one, and a decoder of either event encoding with plain
msgpack, as a listener written from docs/wire.md would."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from benchmarks.engine_sim import EngineSimulator, KvEventsSettings, SimConfig
from benchmarks.engine_sim.kv_events import END_SEQ
from tests.support.poll import async_wait_until

PROBE = b"test-probe"  # topic of the messages EventTap.joined sends to detect the subscription
FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def decode_event(raw: Any) -> dict[str, Any]:
    """One event in either encoding → a dict with 'type'."""
    if isinstance(raw, dict):
        return raw
    tag, *values = raw
    return {"type": tag, **dict(zip(FIELDS[tag], values, strict=False))}


class EventTap:
    """A SUB socket on the simulator's PUB plus a DEALER on its replay ROUTER."""

    def __init__(self, sim: EngineSimulator) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert sim.kv_events_endpoint
        self.sub.connect(sim.kv_events_endpoint)
        self.replay_endpoint = sim.replay_endpoint

    async def joined(self, sim: EngineSimulator, timeout: float = 10.0) -> None:
        """Wait until this SUB receives what the simulator's PUB sends (ZMQ's slow joiner: a PUB drops
        messages until the subscription has reached it). Polls with probe messages on the simulator's PUB
        socket; ``next`` skips them, and they never enter the replay buffer or the sequence."""
        assert sim.publisher is not None and sim.publisher._pub is not None
        pub = sim.publisher._pub

        async def probe_seen() -> bool:
            await pub.send_multipart([PROBE, b"", b""])
            try:
                frames = await asyncio.wait_for(self.sub.recv_multipart(), 0.05)
            except TimeoutError:
                return False
            return frames[0] == PROBE

        await async_wait_until(probe_seen, timeout, interval=0, what="the SUB socket to join the simulator's PUB")

    async def next(self) -> tuple[bytes, int, list[Any]]:
        frames = await asyncio.wait_for(self.sub.recv_multipart(), 10)
        while frames[0] == PROBE:  # a late answer to a probe sent by joined()
            frames = await asyncio.wait_for(self.sub.recv_multipart(), 10)
        topic, seq, payload = frames
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        return topic, int.from_bytes(seq, "big"), events

    async def replay(self, start: int) -> list[list[bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert self.replay_endpoint
        dealer.connect(self.replay_endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
            assert frames[0] == b""  # the delimiter is echoed back to a DEALER
            replies.append(frames[1:])
            if END_SEQ in frames:
                break
        dealer.close(linger=0)
        return replies

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


async def started(config: SimConfig, settings: KvEventsSettings) -> tuple[EngineSimulator, EventTap]:
    sim = EngineSimulator(config, settings)
    await sim.start()
    tap = EventTap(sim)
    await tap.joined(sim)
    return sim, tap
