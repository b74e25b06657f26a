"""The tokenization cache against the real simulator's ``/tokenize`` (kv-sim as a child process): a new turn of
a seen conversation makes no tokenizer call on the request path, and its holds are those a full
tokenization of the prompt finds (over the blocks the cached prefix covers)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson
import pytest

from benchmarks.engine_sim import tokenizer as sim_tok
from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from picker.config import KvCacheIndexConfig, PoolConfig, TokenizerConfig
from picker.facts import RequestFacts, parse_request
from picker.kv.tier4 import Tier4
from picker.kv.tokenizer_sources import TokenizerSource
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.shared.block_keys import request_block_keys
from picker.shared.tiers import StorageTier

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorProcess]:
    p = SimulatorProcess(SimConfig(name="sim-0", model=MODEL, kv_events_enabled=False))
    p.start(timeout_s=60.0)
    try:
        yield p
    finally:
        p.stop()


class CountingSource:
    """The real engine tokenizer source, with every call recorded: (made by a fill worker?, generation prompt)."""

    def __init__(self, inner: TokenizerSource) -> None:
        self.inner = inner
        self.calls: list[tuple[bool, bool]] = []

    async def token_ids(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        task = asyncio.current_task()
        self.calls.append((task is not None and task.get_name().startswith("kv-token-fill"), add_generation_prompt))
        return await self.inner.token_ids(
            model, messages=messages, prompt=prompt, add_generation_prompt=add_generation_prompt
        )

    def on_request_path(self) -> int:
        return sum(1 for fill, _ in self.calls if not fill)

    async def close(self) -> None:
        await self.inner.close()


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1 << 24):x}" for _ in range(n))


def facts(messages: list[dict[str, str]]) -> RequestFacts:
    body = orjson.dumps({"model": MODEL, "messages": messages})
    return parse_request(body, "/v1/chat/completions", max_body_bytes=8 << 20)


async def test_second_turn_makes_no_tokenizer_call_and_holds_match_a_full_tokenization(
    sim: SimulatorProcess,
) -> None:
    # waits long enough that the outcome never depends on the machine's speed (the cache is what is tested)
    tok = TokenizerConfig(endpoint=sim.base_url, timeout_ms=10_000, timeout_max_ms=10_000)
    cfg = KvCacheIndexConfig(enabled=True, tokenizer=tok)
    t4 = Tier4(cfg, Pool(PoolConfig()), PickerMetrics())
    engine = t4.tokenizer
    counting = CountingSource(engine)
    t4.tokenizer = counting
    bs = cfg.tokenizer.block_size
    rng = random.Random(5)
    fills = asyncio.create_task(t4.run_fills())
    try:

        async def turn(msgs: list[dict[str, str]]) -> tuple[Any, int]:
            before = counting.on_request_path()
            held = await t4.lookup(facts(msgs))
            calls = counting.on_request_path() - before
            await t4.tokens.drained()  # the fill runs while the engine answers
            return held, calls

        # a first conversation: cached prefixes are confirmed against its later turns (cache_trust_after: 2)
        warm: list[dict[str, str]] = [{"role": "system", "content": words(rng, 400)}]
        for _ in range(3):
            warm.append({"role": "user", "content": words(rng, 60)})
            _held, calls = await turn(warm)
            assert calls == 1
            warm.append({"role": "assistant", "content": words(rng, 60)})
        assert t4.tokens.trusted(MODEL)

        # a new conversation: its first turn is cold (one call), its second turn makes none
        msgs = [{"role": "system", "content": words(rng, 500)}, {"role": "user", "content": words(rng, 80)}]
        first, calls = await turn(msgs)
        assert calls == 1 and first.exact is True
        reply = {"role": "assistant", "content": words(rng, 100)}
        # what the engines hold now: sim-0 served the first turn (its prompt and reply), sim-1 the system prompt
        t4.index.put(
            "sim-0", request_block_keys(sim_tok.chat_token_ids([*msgs, reply], False), bs, MODEL), StorageTier.GPU_HOT
        )
        t4.index.put(
            "sim-1", request_block_keys(sim_tok.chat_token_ids(msgs[:1], False), bs, MODEL), StorageTier.GPU_HOT
        )
        second_msgs = [*msgs, reply, {"role": "user", "content": words(rng, 40)}]
        calls_before = t4.metrics.registry.get_sample_value("continuum_kv_tokenize_calls_total", {"path": "request"})
        second, calls = await turn(second_msgs)
        assert calls == 0
        assert (
            t4.metrics.registry.get_sample_value("continuum_kv_tokenize_calls_total", {"path": "request"})
            == calls_before
        )
        assert second.exact is False

        # the same prompt tokenized in full by the simulator
        full_ids = await engine.token_ids(MODEL, messages=second_msgs)
        assert full_ids is not None and full_ids == sim_tok.chat_token_ids(second_msgs)
        full_keys = request_block_keys(full_ids, bs, MODEL, max_blocks=t4.max_blocks)
        cached_keys = list(second.block_keys)
        assert cached_keys and cached_keys == full_keys[: len(cached_keys)]
        full_held = t4.index.lookup(full_keys)
        assert set(second.holds) == set(full_held) == {"sim-0", "sim-1"}
        for backend, hold in second.holds.items():
            assert hold.blocks == min(full_held[backend].blocks, len(cached_keys))
            assert hold.tier == full_held[backend].tier
        deepest = max(second.holds, key=lambda b: second.holds[b].blocks)
        assert deepest == max(full_held, key=lambda b: full_held[b].blocks)
        # the estimate of the whole prompt's length is near the true count
        assert abs((second.prompt_tokens or 0) - len(full_ids)) <= 0.2 * len(full_ids)
    finally:
        fills.cancel()
        await asyncio.gather(fills, return_exceptions=True)
        await t4.close()
