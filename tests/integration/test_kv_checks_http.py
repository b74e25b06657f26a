"""Tier 4's truth checks on the picker side (issue 8): a feed that stops while its backend serves
traffic is ``stale`` (an idle one never is), and a request's model resolves to the (model, adapter) the
listener keys with, so LoRA and aliased requests can match.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/kv/test_checks.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from picker.config import FeedChecksConfig
from picker.kv.checks import FeedChecks, FeedWatch


async def test_self_check_needs_every_probe_block_not_only_the_template_header() -> None:
    """Found in review: 'ok' was given as soon as block 0 was held, and block 0 of a chat probe is often
    the template header that other traffic cached already; the nonce's blocks prove the feed."""
    import aiohttp
    from aiohttp import web

    from picker.kv.checks import run_self_check
    from tests.support.http_server import serve

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async def tokenize(model: str, messages: list[dict[str, str]]) -> list[int]:
        return list(range(64))

    checks = FeedChecks(FeedChecksConfig(self_check_timeout_seconds=0.3), ["a"], FeedWatch())
    held: dict[str, Any] = {"a": SimpleNamespace(blocks=1)}  # only the template header's block
    records = iter(range(100))  # the feed moves: records arrive after the probe
    async with serve([web.post("/v1/chat/completions", chat)]) as base, aiohttp.ClientSession() as session:
        address = base.split("://", 1)[1]
        args = (checks, "a", address, "m", tokenize, lambda ids, m: [1, 2, 3, 4], lambda keys: held)
        assert await run_self_check(*args, lambda: next(records), session) == "keys_differ"
        held["a"] = SimpleNamespace(blocks=4)
        assert await run_self_check(*args, lambda: 0, session) == "ok"


async def test_self_check_judges_on_the_engines_full_pages_not_a_partial_last_one() -> None:
    """Issue 20, found on real vLLM (CPU build, pages of 32 tokens): the probe's 243 tokens are 15 key blocks
    of 16, and the engine stores its 7 full pages (14 key blocks). The check demanded all 15: a false
    ``keys_differ`` on every real engine whose page is larger than the key block. It now asks for the key blocks
    inside the full pages, with the page size the feed's puts carry; before any put said it, for all."""
    import aiohttp
    from aiohttp import web

    from picker.kv.checks import full_page_blocks, run_self_check
    from tests.support.http_server import serve

    assert full_page_blocks(243, 15, 32, 16) == 14
    assert full_page_blocks(243, 15, 64, 16) == 12
    assert full_page_blocks(243, 15, 16, 16) == 15
    assert full_page_blocks(243, 15, 1, 16) == 15  # SGLang's page of one token
    assert full_page_blocks(243, 15, None, 16) == 15  # page size unknown: every block
    assert full_page_blocks(20, 1, 32, 16) == 0

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async def tokenize(model: str, messages: list[dict[str, str]]) -> list[int]:
        return list(range(243))

    checks = FeedChecks(FeedChecksConfig(self_check_timeout_seconds=0.3), ["a"], FeedWatch())
    held: dict[str, Any] = {"a": SimpleNamespace(blocks=14)}  # the 7 full pages of 32
    page: list[int | None] = [None]
    async with serve([web.post("/v1/chat/completions", chat)]) as base, aiohttp.ClientSession() as session:
        address = base.split("://", 1)[1]
        keys = list(range(15))
        args = (checks, "a", address, "m", tokenize, lambda ids, m: keys, lambda k: held)
        records = iter(range(100))
        assert await run_self_check(*args, lambda: next(records), session, lambda: page[0], 16) == "keys_differ"
        assert "14" not in checks.detail["a"] and "15 block keys" in checks.detail["a"]
        page[0] = 32
        assert await run_self_check(*args, lambda: 0, session, lambda: page[0], 16) == "ok"
        held["a"] = SimpleNamespace(blocks=13)  # one full page short: still wrong
        assert await run_self_check(*args, lambda: next(records), session, lambda: page[0], 16) == "keys_differ"
        page[0] = 512  # a page longer than the probe: nothing to judge on
        assert await run_self_check(*args, lambda: 0, session, lambda: page[0], 16) == "skipped"
