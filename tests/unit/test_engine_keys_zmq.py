"""Over real ZMQ sockets (ListenerApp, an XPUB publisher): the listener's feed holds exactly the keys the
picker computes for the same request, for what vLLM 0.33 and SGLang 0.5.23 publish (docs/wire.md §3-4).
The feed's key block size is the default (16); engines publish pages of their own size."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from picker.shared.block_keys import request_block_keys
from tests.support.poll import async_wait_until

KB = ListenerConfig().key_block_size
MODEL = "m"
TOKENS = list(range(3000, 3000 + 8 * KB))


class Pub:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            assert (await self.sock.recv())[:1] == b"\x01"

    async def send(self, *events: Any) -> None:
        await self.send_raw(msgpack.packb([0.0, list(events), 0]))

    async def send_raw(self, payload: bytes) -> None:
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@contextlib.asynccontextmanager
async def running(ctx: zmq.asyncio.Context, engine: str = "vllm", **limits: Any) -> AsyncIterator[tuple[Pub, Any]]:
    pub = Pub(ctx)
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        limits=LimitsConfig(**limits),
        sources=(SourceConfig(backend_name="e1", engine=engine, model=MODEL, zmq_endpoint=pub.endpoint),),  # type: ignore[arg-type]
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        await pub.subscribed()
        yield pub, app
    finally:
        await app.stop()


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = KB, **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "medium": "GPU", **kw}  # fmt: skip


def removed(hashes: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def keys(n_blocks: int, **kw: Any) -> set[int]:
    return set(request_block_keys(TOKENS[: n_blocks * KB], KB, MODEL, **kw))


def dropped(app: Any, reason: str) -> float:
    return (
        app.metrics.registry.get_sample_value("kv_listener_events_dropped_total", {"source": "e1", "reason": reason})
        or 0.0
    )


async def settle(pub: Pub, app: Any) -> None:
    """A marker chain on its own root, sent last: once its key is in the feed, everything before is applied."""
    marker = list(range(90_000, 90_000 + KB))
    h = 1_000_000 + pub.seq
    await pub.send(
        stored([h], None, marker, lora_id=9, lora_name=f"marker-{pub.seq}", extra_keys=[[f"marker-{pub.seq}"]])
    )
    key = request_block_keys(marker, KB, MODEL, lora_name=f"marker-{pub.seq - 1}")[0]
    await async_wait_until(lambda: key in app.feeds["e1"].state)
    await pub.send(removed([h]))
    await async_wait_until(lambda: key not in app.feeds["e1"].state)


async def test_salt_and_lora_as_vllm_sends_them(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx) as (pub, app):
        feed = app.feeds["e1"]
        await pub.send(stored([1, 2], None, TOKENS[: 2 * KB], extra_keys=[["tenant-1"], None]))
        await pub.send(stored([3], 2, TOKENS[2 * KB : 3 * KB]))
        lora = {"lora_id": 4, "lora_name": "ad"}
        await pub.send(stored([11, 12], None, TOKENS[: 2 * KB], extra_keys=[["ad", "tenant-1"], ["ad"]], **lora))
        await pub.send(
            stored([21], None, TOKENS[:KB], extra_keys=[["mm-1"], None][:1]),
            stored([22], 21, TOKENS[KB : 2 * KB], extra_keys=[["mm-2"]]),
        )
        want = keys(3, cache_salt="tenant-1") | keys(2, lora_name="ad", cache_salt="tenant-1")
        want |= keys(1, cache_salt="mm-1")  # a lone first-block extra reads as a salt: no request has that key
        await async_wait_until(lambda: set(feed.state) == want)
        await settle(pub, app)
        assert set(feed.state) == want
        notes = app.metrics.registry.get_sample_value(
            "kv_listener_blocks_total", {"source": "e1", "reason": "multimodal"}
        )
        assert notes == 1


async def test_sglang_fields_and_page_size_one(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx, engine="sglang") as (pub, app):
        feed = app.feeds["e1"]
        parent = None
        for i in range(2 * KB + 5):
            await pub.send(stored([-(i + 1)], parent, [TOKENS[i]], bs=1, cache_salt="t", lora_name="ad", lora_id=1))
            parent = -(i + 1)
        await async_wait_until(lambda: set(feed.state) == keys(2, lora_name="ad", cache_salt="t"))
        await pub.send(removed([-(i + 1) for i in range(2 * KB + 4, KB - 1, -1)]))
        await async_wait_until(lambda: set(feed.state) == keys(1, lora_name="ad", cache_salt="t"))


async def test_groups_copies_media_and_placeholders(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx) as (pub, app):
        feed = app.feeds["e1"]
        k = request_block_keys(TOKENS[: 4 * KB], KB, MODEL)
        # vLLM block size 32: two pages, four keys; group 1 holds the same hashes
        await pub.send(
            stored([1, 2], None, TOKENS[: 4 * KB], bs=32, group_idx=0),
            stored([1, 2], None, TOKENS[: 4 * KB], bs=32, group_idx=1),
        )
        await async_wait_until(lambda: set(feed.state) == set(k))
        await pub.send(removed([2], group_idx=1))  # group 0 still holds it
        await pub.send(
            stored([2], None, [], bs=0, medium="CPU"), stored([2], 1, TOKENS[2 * KB : 4 * KB], bs=32, medium="STORAGE")
        )
        await pub.send(removed([2], group_idx=0))
        await async_wait_until(lambda: feed.state.get(k[3]) == "storage_warm")
        await pub.send(removed([2], medium="STORAGE"))  # still on CPU
        await settle(pub, app)
        assert feed.state == {k[0]: "gpu_hot", k[1]: "gpu_hot", k[2]: "storage_warm", k[3]: "storage_warm"}
        await pub.send(removed([2], medium="CPU"))
        await async_wait_until(lambda: set(feed.state) == set(k[:2]))


async def test_decoder_bombs_are_dropped_and_the_listener_keeps_working(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx) as (pub, app):
        feed = app.feeds["e1"]
        # 3 MB of empty arrays (60 x 50,000): three million containers, each array inside every length limit
        inner = b"\xdd" + (50_000).to_bytes(4, "big") + b"\x90" * 50_000
        bomb = b"\x93\xcb" + b"\0" * 8 + b"\xdc" + (60).to_bytes(2, "big") + inner * 60 + b"\x00"
        await pub.send_raw(bomb)
        await pub.send(removed(list(range(1, LimitsConfig().max_event_hashes + 2))))  # one event, too many hashes
        await pub.send(stored([1], None, TOKENS[:KB]))
        await async_wait_until(lambda: set(feed.state) == keys(1))
        assert dropped(app, "too_large") == 2
