"""TensorRT-LLM source against a small aiohttp server serving POST /kv_cache_events."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig
from listener.trtllm_source import TrtllmHttpSource
from picker.shared.block_keys import request_block_keys
from tests.support.http_server import serve

BS = 4
TOK = list(range(500, 512))


def blk(h: int, toks: list[int], level: int = 0) -> dict[str, Any]:
    return {"block_hash": h, "tokens": [{"token_id": t, "token_extra_id": 0} for t in toks], "cache_level": level}


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[Any]]]:
    queue: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        body = queue.pop(0) if queue else []
        return web.Response(body=body if isinstance(body, bytes) else json.dumps(body).encode())

    async with serve([web.post("/kv_cache_events", handler)]) as url:
        yield url, queue


def make(url: str, **kw: Any) -> tuple[ListenerApp, TrtllmHttpSource]:
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        sources=(SourceConfig(backend_name="t1", engine="trtllm", model="m", block_size=BS, http_endpoint=url, **kw),),
    )
    app = ListenerApp(cfg)
    src = app.sources["t1"]
    assert isinstance(src, TrtllmHttpSource)
    return app, src


async def test_trtllm_events(server: tuple[str, list[Any]]) -> None:
    url, queue = server
    app, src = make(url)
    feed = app.feeds["t1"]
    keys = request_block_keys(TOK, BS, "m")
    queue.extend(
        [
            [
                {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]}},
                {
                    "event_id": 1,
                    "data": {"type": "stored", "parent_hash": None, "blocks": [blk(1, TOK[:4]), blk(2, TOK[4:8])]},
                },
            ],
            [
                {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [blk(9, TOK[:4])]}},  # dup
                {"event_id": 2, "data": {"type": "stored", "parent_hash": 2, "blocks": [blk(3, TOK[8:12], level=1)]}},
                {"event_id": 3, "data": {"type": "updated", "block_hash": 3}},
                {"event_id": 4, "data": {"type": "removed", "block_hashes": [2]}},
                {"event_id": 5, "data": {"type": "stored", "blocks": "nope"}},
            ],
            b"{not json",
            [{"event_id": 9, "data": {"type": "stored", "parent_hash": None, "blocks": [blk(5, TOK[:4])]}}],  # gap
            [{"event_id": 0, "data": {"type": "created"}}],  # restart
        ]
    )
    async with aiohttp.ClientSession() as s:
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot", keys[1]: "gpu_hot"}
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot", keys[2]: "storage_warm"}
        await src.poll_once(s)  # malformed body: counted, state kept
        assert len(feed.state) == 2
        await src.poll_once(s)
        assert feed.state == {keys[0]: "gpu_hot"}  # the gap cleared the old state first
        await src.poll_once(s)
        assert feed.state == {}
    m = app.metrics.registry

    def v(name: str, **lab: str) -> float:
        return m.get_sample_value(name, {"source": "t1", **lab}) or 0.0

    assert v("kv_listener_events_dropped_total", reason="duplicate") == 1
    assert v("kv_listener_events_dropped_total", reason="malformed") == 2
    assert v("kv_listener_sequence_gaps_total") == 1
    assert v("kv_listener_engine_restarts_total") == 1


async def test_trtllm_host_not_allowed(server: tuple[str, list[Any]]) -> None:
    url, _ = server
    _app, src = make(url, allowed_publishers=("10.1.1.1",))
    await src.run()  # returns at once: never polls a host outside the allow-list
    assert not src.connected


def test_cli_config_errors_name_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  - backend_name: 'bad name!'\n    model: m\n    zmq_endpoint: tcp://x:1\n    bogus: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "listener.cli", "check", "--config", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "sources[0].backend_name" in r.stderr and "sources[0].bogus" in r.stderr
    good = tmp_path / "good.yaml"
    good.write_text("sources:\n  - backend_name: e1\n    model: m\n    zmq_endpoint: tcp://127.0.0.1:5557\n")
    r = subprocess.run([sys.executable, "-m", "listener.cli", "check", "--config", str(good)], capture_output=True)
    assert r.returncode == 0
