"""listener.trtllm_source: the poller against a small aiohttp server serving POST /kv_cache_events (ids, gaps,
restarts, bad bodies, the allow-list, a response over the bound) and the decoder of its JSON events.

The tests that start a server or bind a socket: tests/integration/test_listener_trtllm_source.py."""

from __future__ import annotations

import pytest

from listener.events import BlockRemoved, BlockStored, DecodeError, SourceReset
from listener.trtllm_source import decode_trtllm_event
from tests.support.trtllm_events import TOK, blk, make


def test_the_source_opens_nothing_queues_nothing_and_persists_nothing() -> None:
    _app, src = make("http://127.0.0.1:1/")
    assert src.url == "http://127.0.0.1:1/kv_cache_events" and src.endpoint == "http://127.0.0.1:1/"
    src.open()
    src.close()
    assert src.backlog_bytes is None and src.persistence() is None and src.status(60)["last_seq"] is None


def test_decode_trtllm_event() -> None:
    stored = decode_trtllm_event(
        {"type": "stored", "parent_hash": 7, "blocks": [blk(1, TOK[:4]), blk(2, TOK[4:8], level=1)]}, 1 << 20
    )
    assert stored == [
        BlockStored((1,), 7, TOK[:4], 4, medium="GPU"),
        BlockStored((2,), 1, TOK[4:8], 4, medium="CPU"),  # chained through the previous block; level 1: CPU
    ]
    extra = [{"token_id": 5, "token_extra_id": 3}]
    (unkeyable,) = decode_trtllm_event({"type": "stored", "blocks": [{"block_hash": 1, "tokens": extra}]}, 99) or []
    assert isinstance(unkeyable, BlockStored) and unkeyable.first_unkeyable == 0
    assert decode_trtllm_event({"type": "removed", "block_hashes": [1, -1]}, 99) == [
        BlockRemoved((1, (1 << 64) - 1), medium=None)
    ]
    assert decode_trtllm_event({"type": "created"}, 99) == [SourceReset()]
    assert decode_trtllm_event({"type": "updated", "block_hash": 1}, 99) is None
    bad: list[tuple[object, str]] = [
        ("not a dict", "malformed"),
        ({"type": "nope"}, "malformed"),
        ({"type": "removed", "block_hashes": "x"}, "malformed"),
        ({"type": "stored", "blocks": [{"block_hash": 1, "tokens": [{"token_id": -1}]}]}, "malformed"),
        ({"type": "stored", "blocks": [{"block_hash": 1, "tokens": [{"token_id": True}]}]}, "malformed"),
        ({"type": "stored", "blocks": [blk(1, TOK[:4]), blk(2, TOK[4:8])]}, "too_large"),  # over 6 tokens
    ]
    for data, reason in bad:
        with pytest.raises(DecodeError) as exc:
            decode_trtllm_event(data, 6)
        assert exc.value.reason == reason
