"""Tier 4's truth checks: is each backend's feed telling the truth about its engine (a feed that stops while its
backend serves traffic; keys that never match, found by a start-up self-check)? They report, never route.
See docs/picker.md, "Truth checks".
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from picker.config import FeedChecksConfig
from picker.routing.endpoints import Decision
from picker.shared.block_keys import request_block_keys

log = logging.getLogger("kv_epp.kv_checks")

FEED_STATES = ("connecting", "live", "stale", "disconnected")
SELF_CHECK_RESULTS = ("pending", "ok", "keys_differ", "no_events", "probe_failed", "skipped")
PROBE_WORDS = 96  # ~ several blocks of 16 tokens with any tokenizer
PROBE_BODY_LIMIT = 1 << 20


@dataclass(slots=True)
class _Progress:
    """Per backend: the feed's record count and the served count when that count last moved."""

    records: int = -1
    served_then: int = 0
    since: float = 0.0


class Routed(Protocol):
    """What ``FeedWatch`` reads of an exchange (``picker.request.path.Exchange``): its decision."""

    @property
    def decision(self) -> Decision: ...


class FeedWatch:
    """Response observer: counts the responses each backend served (status < 500), nothing per chunk."""

    wants_body = False

    def __init__(self) -> None:
        # bound: the backends with a feed (FeedChecks adds and removes them)
        self.served: dict[str, int] = {}

    def on_headers(self, ex: Routed, status: int | None) -> None:
        if status is not None and status < 500:
            name = ex.decision.endpoint.name
            n = self.served.get(name)
            if n is not None:  # only backends with a feed are counted (FeedChecks adds and removes them)
                self.served[name] = n + 1

    def on_body(self, ex: Routed, chunk: bytes, end: bool) -> None:
        return None

    def on_end(self, ex: Routed, completed: bool) -> None:
        return None


def probe_messages(nonce: str) -> list[dict[str, str]]:
    """The self-check's chat messages: a fresh nonce first, so no engine holds the prefix already."""
    words = " ".join(f"w{i}" for i in range(PROBE_WORDS))
    return [{"role": "user", "content": f"kv-epp self-check {nonce}: {words}"}]


class FeedChecks:
    """The stale-feed judgement and the self-check results of every backend with a feed."""

    def __init__(
        self,
        cfg: FeedChecksConfig,
        backends: Sequence[str],
        watch: FeedWatch,
        metrics_state: Any | None = None,
        metrics_check: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.watch = watch
        self.state: dict[str, str] = {b: "connecting" for b in backends}
        self.self_check: dict[str, str] = {b: "pending" if cfg.self_check else "skipped" for b in backends}
        self.detail: dict[str, str] = {}
        self._progress: dict[str, _Progress] = {b: _Progress() for b in backends}
        self._g_state = metrics_state
        self._g_check = metrics_check
        self.on_change: Callable[[str], None] | None = None  # told (backend) when its feed state changes
        for b in backends:
            watch.served.setdefault(b, 0)
            self._export(b)

    def add(self, backend: str) -> None:
        """A backend with a feed joined the pool (or its name now points at a new engine): judged afresh,
        self-checked again."""
        self.state[backend] = "connecting"
        self.self_check[backend] = "pending" if self.cfg.self_check else "skipped"
        self.detail.pop(backend, None)
        self._progress[backend] = _Progress()
        self.watch.served[backend] = 0
        self._export(backend)

    def remove(self, backend: str) -> None:
        """A backend left the pool: its state goes (the caller removes its metric series)."""
        self.state.pop(backend, None)
        self.self_check.pop(backend, None)
        self.detail.pop(backend, None)
        self._progress.pop(backend, None)
        self.watch.served.pop(backend, None)

    def _export(self, backend: str) -> None:
        if self._g_state is not None:
            for s in FEED_STATES:
                self._g_state.labels(backend, s).set(1 if self.state[backend] == s else 0)
        if self._g_check is not None:
            for r in SELF_CHECK_RESULTS:
                self._g_check.labels(backend, r).set(1 if self.self_check[backend] == r else 0)

    def judge(self, backend: str, connected: bool, records: int, now: float | None = None) -> str:
        """Update and return ``backend``'s feed state from its consumer's connection and record count."""
        t = time.monotonic() if now is None else now
        p = self._progress.get(backend)
        if p is None:  # left the pool meanwhile
            return "disconnected"
        served = self.watch.served.get(backend, 0)
        if records != p.records:  # the feed moved (or first look): traffic is measured from here
            p.records, p.served_then, p.since = records, served, t
        if not connected:
            state = "disconnected" if self.state[backend] != "connecting" else "connecting"
        elif served - p.served_then >= self.cfg.stale_after_requests and t - p.since >= self.cfg.stale_after_seconds:
            state = "stale"
        else:
            state = "live"
        if state != self.state[backend]:
            level = logging.WARNING if state in ("stale", "disconnected") else logging.INFO
            log.log(
                level,
                "event=kv_feed_state backend=%s state=%s served_since_last_record=%d",
                backend,
                state,
                served - p.served_then,
            )
            self.state[backend] = state
            self._export(backend)
            if self.on_change is not None:
                self.on_change(backend)
        return state

    def set_self_check(self, backend: str, result: str, detail: str = "") -> None:
        if backend not in self.state:  # left the pool while its probe ran
            return
        self.self_check[backend] = result
        self.detail[backend] = detail
        level = logging.INFO if result in ("ok", "skipped") else logging.WARNING
        log.log(level, "event=kv_self_check backend=%s result=%s detail=%r", backend, result, detail)
        self._export(backend)

    def report(self) -> dict[str, dict[str, str]]:
        """``/readyz`` detail: per backend, the feed state and the self-check result (with why)."""
        out = {}
        for b, state in self.state.items():
            entry = {"feed": state, "self_check": self.self_check[b]}
            if self.detail.get(b):
                entry["detail"] = self.detail[b]
            out[b] = entry
        return out


async def run_self_check(
    checks: FeedChecks,
    backend: str,
    address: str,
    model: str | None,
    tokenize: Callable[[str, list[dict[str, str]]], Any],
    keys_for: Callable[[Sequence[int], str], list[int]],
    holds: Callable[[Sequence[int]], Mapping[str, Any]],
    records: Callable[[], int],
    session: aiohttp.ClientSession,
    page_tokens: Callable[[], int | None] = lambda: None,
    key_block_size: int = 0,
) -> str:
    """Probe ``backend`` once (docs/picker.md, "Truth checks"); record and return the result."""
    if model is None:
        checks.set_self_check(backend, "skipped", "no model: set kv_cache_index.checks.self_check_model")
        return "skipped"
    messages = probe_messages(secrets.token_hex(8))
    try:
        ids = await tokenize(model, messages)
    except Exception as exc:  # a tokenizer failure is a probe failure, never a crash
        ids = None
        log.debug("event=kv_self_check_tokenize_failed error=%r", exc)
    if not ids:
        checks.set_self_check(backend, "probe_failed", "the tokenizer gave no token ids for the probe")
        return "probe_failed"
    keys = keys_for(ids, model)
    if not keys:
        checks.set_self_check(backend, "skipped", "the probe is shorter than one block")
        return "skipped"
    before = records()
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    try:
        async with session.post(f"http://{address}/v1/chat/completions", json=body) as resp:
            await resp.content.read(PROBE_BODY_LIMIT)
            if resp.status >= 400:
                checks.set_self_check(backend, "probe_failed", f"the engine answered {resp.status} to the probe")
                return "probe_failed"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        checks.set_self_check(backend, "probe_failed", f"probe request failed: {type(exc).__name__}")
        return "probe_failed"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + checks.cfg.self_check_timeout_seconds
    want = len(keys)
    while loop.time() < deadline:
        want = full_page_blocks(len(ids), len(keys), page_tokens(), key_block_size)
        if want == 0:
            checks.set_self_check(
                backend, "skipped", f"the probe is shorter than one engine page ({page_tokens()} tokens)"
            )
            return "skipped"
        held = holds(keys).get(backend)
        if held is not None and held.blocks >= want:  # every key block of the full pages, the nonce's too
            checks.set_self_check(backend, "ok")
            return "ok"
        await asyncio.sleep(0.05)
    if records() != before:
        checks.set_self_check(
            backend,
            "keys_differ",
            f"the feed delivered records after the probe but not its {want} block keys for model "
            f"{model!r}: the listener's model name, key block size or the chat template differ from the picker's",
        )
        return "keys_differ"
    checks.set_self_check(
        backend, "no_events", "no feed record arrived after the probe: the engine's KV events do not reach the listener"
    )
    return "no_events"


def full_page_blocks(tokens: int, keys: int, page: int | None, key_block_size: int) -> int:
    """How many of a ``tokens``-token prompt's ``keys`` key blocks an engine with ``page``-token pages stores:
    those ending inside its full pages (all of them while the page size is unknown)."""
    if not page or key_block_size <= 0:
        return keys
    return min(keys, (tokens // page) * page // key_block_size)


def probe_keys(block_size: int, max_blocks: int) -> Callable[[Sequence[int], str], list[int]]:
    """The picker's block keys for the probe's token ids (no adapter, no salt)."""

    def keys(ids: Sequence[int], model: str) -> list[int]:
        return request_block_keys(ids, block_size, model, max_blocks=max_blocks)

    return keys
