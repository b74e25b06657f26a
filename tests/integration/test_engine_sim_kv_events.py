"""KV events over real ZMQ: both encodings, both hash forms, replay layouts, restart, SGLang flavour.

Decoding here uses plain msgpack only, as a listener written from docs/wire.md would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from benchmarks.engine_sim import EngineSimulator, KvEventsSettings, SimConfig
from benchmarks.engine_sim.kv_events import END_SEQ
from benchmarks.engine_sim.prefix_cache import hash_as_int64, hash_as_uint64
from benchmarks.engine_sim.tokenizer import encode
from tests.support.sim_events import decode_event, started

BS = 16


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def complete(http: aiohttp.ClientSession, sim: EngineSimulator, words: list[str]) -> None:
    body = {"prompt": " ".join(words), "max_tokens": 1}
    async with http.post(sim.base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("hash_form", ["uint64", "bytes"])
async def test_events_decode_to_exactly_the_cached_blocks(
    http: aiohttp.ClientSession, encoding: str, hash_form: str
) -> None:
    config = SimConfig(time_scale=0.001, block_size=BS, capacity_blocks=8)
    settings = KvEventsSettings(encoding=encoding, hash_form=hash_form, topic="kv@sim-0@sim-model")  # type: ignore[arg-type]
    sim, tap = await started(config, settings)
    form = hash_as_uint64 if hash_form == "uint64" else bytes
    try:
        held: dict[Any, list[int]] = {}  # wire hash -> block tokens, rebuilt from events only
        expected_seq = 0
        prompts = [[f"p{i}w{j}" for j in range(40)] for i in range(4)]  # 2 full blocks + 8 tokens each
        for words in prompts:
            await complete(http, sim, words)
            saw_store = False
            while not saw_store:
                topic, seq, events = await tap.next()
                assert topic == b"kv@sim-0@sim-model" and seq == expected_seq
                expected_seq += 1
                for raw in events:
                    event = decode_event(raw)
                    assert isinstance(raw, dict if encoding == "map" else list)
                    if event["type"] == "BlockRemoved":
                        assert event["medium"] == "GPU"
                        for h in event["block_hashes"]:
                            del held[h]
                    elif event["type"] == "BlockStored":
                        saw_store = True
                        hashes, tokens = event["block_hashes"], event["token_ids"]
                        assert event["medium"] == "GPU" and event["block_size"] == BS
                        assert len(tokens) == len(hashes) * BS
                        assert event["parent_block_hash"] is None
                        assert tokens == encode(" ".join(words))[: len(hashes) * BS]
                        for k, h in enumerate(hashes):
                            held[h] = tokens[k * BS : (k + 1) * BS]
        # capacity 8 with 2 blocks per prompt (3 slots while running): evictions must have happened
        assert 0 < len(held) < 8
        cached = {form(d) for d in sim.cache._blocks}
        assert set(held) == cached
        assert all(isinstance(h, int if hash_form == "uint64" else bytes) for h in held)
    finally:
        tap.close()
        await sim.stop()


@pytest.mark.parametrize("layout", ["seq", "topic"])
async def test_dropped_batches_leave_a_gap_that_replay_fills(http: aiohttp.ClientSession, layout: str) -> None:
    settings = KvEventsSettings(replay_layout=layout, topic="t")  # type: ignore[arg-type]
    sim, tap = await started(SimConfig(time_scale=0.001), settings)
    try:
        sim.set_faults(drop_event_batches=2)
        for i in range(3):
            await complete(http, sim, [f"r{i}w{j}" for j in range(20)])
        _, seq, events = await tap.next()
        assert seq == 2  # 0 and 1 were dropped: the subscriber sees a gap
        replies = await tap.replay(0)
        if layout == "topic":
            assert all(r[0] == b"t" for r in replies[:-1]) and replies[-1] == [b"", END_SEQ, b""]
            replies = [r[1:] for r in replies]
        else:
            assert replies[-1] == [END_SEQ, b""]
        assert [int.from_bytes(r[0], "big") for r in replies[:-1]] == [0, 1, 2]
        assert msgpack.unpackb(replies[2][1])[1] == events
        partial = await tap.replay(1)
        assert len(partial) == 3  # seq 1, 2 and the end marker
    finally:
        tap.close()
        await sim.stop()


async def test_restart_resets_sequence_and_sends_all_blocks_cleared(http: aiohttp.ClientSession) -> None:
    sim, tap = await started(SimConfig(time_scale=0.001), KvEventsSettings(encoding="map"))
    try:
        for i in range(2):
            await complete(http, sim, [f"s{i}w{j}" for j in range(20)])
            assert (await tap.next())[1] == i
        async with http.post(sim.base_url + "/sim/restart") as resp:
            assert (await resp.json())["next_seq"] == 1
        _, seq, events = await tap.next()
        assert seq == 0 and events == [{"type": "AllBlocksCleared"}]
        assert len(sim.cache) == 0
        replies = await tap.replay(0)
        assert len(replies) == 2  # the buffer was emptied: only the AllBlocksCleared batch survives
        await complete(http, sim, [f"s0w{j}" for j in range(20)])
        assert (await tap.next())[1] == 1
    finally:
        tap.close()
        await sim.stop()


async def test_sglang_flavour(http: aiohttp.ClientSession) -> None:
    settings = KvEventsSettings(flavour="sglang", encoding="map", replay_layout="topic")
    sim, tap = await started(SimConfig(time_scale=0.001, block_size=BS), settings)
    try:
        words = [f"g{j}" for j in range(50)]  # 3 full pages
        await complete(http, sim, words)
        _, seq, events = await tap.next()
        assert seq == 0 and len(events) == 3  # one BlockStored per page
        digests = sim.cache.block_hashes(encode(" ".join(words)))
        parent = None
        for event, digest in zip(events, digests, strict=True):
            assert event["type"] == "BlockStored" and "lora_id" not in event  # None fields omitted
            assert event["block_hashes"] == [hash_as_int64(digest)]
            assert event.get("parent_block_hash") == parent
            parent = hash_as_int64(digest)
        replies = await tap.replay(0)
        assert [len(r) for r in replies] == [2, 2]  # SGLang replies are 2-frame whatever the layout
    finally:
        tap.close()
        await sim.stop()


async def test_publisher_connects_to_a_binding_subscriber() -> None:
    """Connect mode (endpoint without a wildcard): the simulator's PUB dials the subscriber's address.

    Checked by the handshake seen on the subscriber side. Delivery is not asserted: in this
    environment (libzmq 4.3.5, pyzmq 27.3) a bound SUB fed by a connecting PUB receives nothing even
    with plain pyzmq sockets, although the ZMTP handshake succeeds.
    """
    from zmq.utils.monitor import parse_monitor_message

    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket()
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    sim = EngineSimulator(SimConfig(time_scale=0.001), KvEventsSettings(endpoint=endpoint, replay_endpoint=None))
    await sim.start()
    try:
        assert sim.kv_events_endpoint == endpoint and sim.replay_endpoint is None
        while True:
            event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10))
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
    finally:
        await sim.stop()
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
