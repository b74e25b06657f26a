"""A TensorRT-LLM HTTP source on a listener app, and the blocks its /kv_cache_events answers carry."""

from __future__ import annotations

from typing import Any

from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig
from listener.trtllm_source import TrtllmHttpSource

BS = 4
TOK = list(range(500, 512))


def blk(h: int, toks: list[int], level: int = 0) -> dict[str, Any]:
    return {"block_hash": h, "tokens": [{"token_id": t, "token_extra_id": 0} for t in toks], "cache_level": level}


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
