"""Tier 4's request-path cost: the picker's prepare stage against the real simulator's ``/tokenize``.

    python -m benchmarks.prepare_cost [--conversations 200] [--cold 100] [--large 20] [--json PATH]

Starts kv-sim (a child process) as the engine tokenizer, builds a ``PickerApp`` with Tier 4 on and the
default tokenizer settings (the tokenization cache, its fill workers running), fills the KV index with
what the engine would hold (each served prompt plus its reply, from the simulator's own tokenizer), and
times ``RequestPath.prepare`` (prefix key, Tier 4 holds) per request for:

- ``multi_turn``: the last turn of a conversation (~4,000 tokens: a 1,200-word system prompt, 8 turns of an
  80-word question and a 320-word reply) whose earlier turns were seen; each conversation's turns run in
  order, with the cache's fills drained between turns (a reply takes longer than a fill);
- ``first_turn``: a conversation's first, ~4,000-token turn with a system prompt never seen (cold);
- ``large_220kb``: a first turn whose user message is 220 KB of text (cold; routed by Tier 4 only if its
  holds are found, i.e. the tokenizer answered within the size-scaled timeout);
- ``large_220kb_again``: the same 220 KB requests once more (their whole prompt is cached);
- ``token_ids``: a completions prompt of 4,000 token ids (used as sent).

Prints, per case, the prepare stage's wall time p50/p99/max, the tokenizer calls per request on the
request path and in the background (the picker's ``continuum_kv_tokenize_calls_total``), and the share of
requests that got holds (routed by Tier 4) and that were keyed exactly. The machine may be shared: the
figures are of this run only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchmarks.engine_sim import tokenizer as sim_tok
from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import KvEventsSettings
from benchmarks.engine_sim.process import SimulatorProcess
from picker.api import Inbound, PickerApp, build_app, parse_settings
from picker.shared.block_keys import request_block_keys
from picker.shared.tiers import StorageTier

MODEL = "sim-model"
BACKENDS = ("sim-0", "sim-1")
CHAT = "/v1/chat/completions"
SYSTEM_WORDS = 1_200
TURNS = 8
QUESTION_WORDS = 80
REPLY_WORDS = 320
LARGE_BYTES = 220_000


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1 << 24):x}" for _ in range(n))


def text_of_bytes(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = f"w{rng.randrange(1 << 24):x}"
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@dataclass
class Case:
    name: str
    times_ms: list[float] = field(default_factory=list)
    request_calls: float = 0
    background_calls: float = 0
    held: int = 0
    exact: int = 0
    tokens: list[int] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)  # |prompt_tokens - true count| / true count

    def row(self) -> dict[str, Any]:
        n = len(self.times_ms)
        t = sorted(self.times_ms)
        return {
            "case": self.name,
            "requests": n,
            "p50_ms": round(statistics.median(t), 3) if t else None,
            "p99_ms": round(t[min(n - 1, int(0.99 * n))], 3) if t else None,
            "max_ms": round(t[-1], 3) if t else None,
            "tokenizer_calls_per_request": round(self.request_calls / n, 3) if n else None,
            "background_calls_per_request": round(self.background_calls / n, 3) if n else None,
            "routed_by_tier4": round(self.held / n, 3) if n else None,
            "exact": round(self.exact / n, 3) if n else None,
            "prompt_tokens_median": int(statistics.median(self.tokens)) if self.tokens else None,
            "prompt_tokens_error_median": round(statistics.median(self.errors), 4) if self.errors else None,
            "prompt_tokens_error_max": round(max(self.errors), 4) if self.errors else None,
        }


class Bench:
    def __init__(self, app: PickerApp) -> None:
        self.app = app
        tier4 = app.tier4
        assert tier4 is not None
        self.tier4 = tier4

    def calls(self, path: str) -> float:
        v = self.app.metrics.registry.get_sample_value("continuum_kv_tokenize_calls_total", {"path": path})
        return v or 0.0

    def hold(self, backend: str, ids: list[int]) -> None:
        """The engine ``backend`` holds these ids' full blocks (what the feed would have told the index)."""
        bs = self.app.settings.kv_cache_index.tokenizer.block_size
        self.tier4.index.put(backend, request_block_keys(ids, bs, MODEL), StorageTier.GPU_HOT)

    async def prepare(self, case: Case | None, path: str, body: dict[str, Any], true_tokens: int = 0) -> None:
        """One request through parse + prepare; only prepare is timed (and booked when ``case`` is given).
        ``true_tokens``: the prompt's true length, to judge Tier 4's estimate of it."""
        raw = orjson.dumps(body)
        facts = self.app.path.parse(Inbound(path, {":method": "POST", "content-type": "application/json"}, raw))
        req0, bg0 = self.calls("request"), self.calls("background")
        t0 = time.perf_counter()
        prepared = await self.app.path.prepare(facts)
        dt = time.perf_counter() - t0
        await self.tier4.tokens.drained()  # the fills run while the engine would answer, not in the timing
        if case is None:
            return
        case.times_ms.append(dt * 1000)
        case.request_calls += self.calls("request") - req0
        case.background_calls += self.calls("background") - bg0
        holds = prepared.holds
        case.held += bool(holds)
        case.exact += bool(getattr(holds, "exact", False))
        if prepared.prompt_tokens is not None:
            case.tokens.append(prepared.prompt_tokens)
            if true_tokens:
                case.errors.append(abs(prepared.prompt_tokens - true_tokens) / true_tokens)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    sim = SimulatorProcess(SimConfig(name="sim-0", model=MODEL, kv_events_enabled=False), KvEventsSettings())
    sim.start()
    try:
        settings = parse_settings(
            {
                "prefix_routing": {"enabled": True},
                "kv_cache_index": {
                    "enabled": True,
                    "max_entries": 2_000_000,  # every conversation's blocks stay in the index
                    "tokenizer": {"endpoint": sim.base_url},
                },
                "pool": {
                    "backends": [
                        {"name": BACKENDS[0], "address": sim.address},
                        {"name": BACKENDS[1], "address": "127.0.0.1:9"},  # never contacted: the index's other holder
                    ]
                },
            }
        )
        app = build_app(settings)
        bench = Bench(app)
        fills = asyncio.create_task(bench.tier4.run_fills())
        try:
            return await _cases(bench, rng, args)
        finally:
            fills.cancel()
            await asyncio.gather(fills, return_exceptions=True)
            await bench.tier4.close()
    finally:
        sim.stop()


async def _cases(bench: Bench, rng: random.Random, args: argparse.Namespace) -> list[dict[str, Any]]:
    body = {"model": MODEL, "max_tokens": 1}
    gc.collect()
    # (a) multi-turn: every turn of each conversation in order; the last (~4,000 tokens) is measured
    multi = Case("multi_turn")
    for c in range(args.conversations):
        holder = BACKENDS[c % 2]
        msgs: list[dict[str, str]] = [{"role": "system", "content": words(rng, SYSTEM_WORDS)}]
        for turn in range(TURNS):
            msgs.append({"role": "user", "content": words(rng, QUESTION_WORDS)})
            last = turn == TURNS - 1
            true = len(sim_tok.chat_token_ids(msgs)) if last else 0
            await bench.prepare(multi if last else None, CHAT, {**body, "messages": msgs}, true)
            reply = {"role": "assistant", "content": words(rng, REPLY_WORDS)}
            bench.hold(holder, sim_tok.chat_token_ids([*msgs, reply], add_generation_prompt=False))
            msgs.append(reply)
    # (b) a cold first turn of ~4,000 tokens
    cold = Case("first_turn")
    for c in range(args.cold):
        msgs = [
            {"role": "system", "content": words(rng, SYSTEM_WORDS * 3)},
            {"role": "user", "content": words(rng, 300)},
        ]
        bench.hold(BACKENDS[c % 2], sim_tok.chat_token_ids(msgs))
        await bench.prepare(cold, CHAT, {**body, "messages": msgs}, len(sim_tok.chat_token_ids(msgs)))
    # (c) 220 KB prompts, cold, then the same again
    large = Case("large_220kb")
    again = Case("large_220kb_again")
    bodies = []
    for c in range(args.large):
        msgs = [{"role": "user", "content": text_of_bytes(rng, LARGE_BYTES)}]
        bench.hold(BACKENDS[c % 2], sim_tok.chat_token_ids(msgs))
        bodies.append({**body, "messages": msgs})
    for b in bodies:
        await bench.prepare(large, CHAT, b)
    for b in bodies:
        await bench.prepare(again, CHAT, b)
    # (d) token ids as sent
    ids_case = Case("token_ids")
    for c in range(args.cold):
        ids = [rng.randrange(256, 32_000) for _ in range(4_000)]
        bench.hold(BACKENDS[c % 2], ids)
        await bench.prepare(ids_case, "/v1/completions", {**body, "prompt": ids})
    return [case.row() for case in (multi, cold, large, again, ids_case)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prepare_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=200, help="multi-turn conversations (last turns measured)")
    p.add_argument("--cold", type=int, default=100, help="cold first turns, and token-id prompts")
    p.add_argument("--large", type=int, default=20, help="220 KB prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    cols = (
        "case",
        "requests",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "tokenizer_calls_per_request",
        "background_calls_per_request",
        "routed_by_tier4",
        "exact",
        "prompt_tokens_median",
        "prompt_tokens_error_median",
        "prompt_tokens_error_max",
    )
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
