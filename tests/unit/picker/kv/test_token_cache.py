"""The tokenization cache (``picker.kv.token_cache``): keys from cached prefixes equal a full tokenization's,
the safety margin and the refusal against tokenizers that are not prefix-preserving, bounds and eviction,
the fill queue's bound, injective keys, and Tier 4's use of it (``KvLookup.prompt_tokens``/``exact``, the
size-scaled timeout, a local tokenizer whose work stays off the event loop)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from benchmarks.engine_sim import tokenizer as sim_tok
from picker.config import KvCacheIndexConfig, PoolConfig, TokenizerConfig
from picker.facts import RequestFacts, parse_request
from picker.kv.tier4 import Tier4
from picker.kv.token_cache import ENTRY_OVERHEAD, MARKER_COST, CachedTokenizer, Entry, TokenCache
from picker.kv.token_keys import chain_digest, chat_segments, prompt_cuts, prompt_segments, root_digest, safe_length
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.shared.block_keys import request_block_keys, root_key

BS = 16
MODEL = "sim-model"
ROOT = root_key(MODEL)


class SimSource:
    """The simulator's own tokenizer and chat template, in process (the same ids kv-sim's /tokenize gives),
    counting calls by kind: ``request`` (chat with the generation prompt, or a prompt string asked by the
    request path) and ``fill`` (chat without the generation prompt, or a prompt asked by a fill)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.in_fill = False

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        return sim_tok.chat_token_ids(messages, add_generation_prompt)

    async def token_ids(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        task = asyncio.current_task()
        fill = task is not None and task.get_name().startswith("kv-token-fill")
        self.calls.append(("fill" if fill else "request", add_generation_prompt))
        if messages is not None:
            return self.render(messages, add_generation_prompt)
        return sim_tok.encode(prompt or "")

    def request_calls(self) -> int:
        return sum(1 for kind, _ in self.calls if kind == "request")

    async def close(self) -> None:
        return None


class FakeMergingTokenizer(SimSource):
    """A FAKE tokenizer that is not prefix-preserving at the end of a rendering: when a rendering ends (no
    generation prompt, nothing follows), its last ``reach`` tokens come out as different ids than when more
    text follows them (a BPE merge over the boundary, a template closing the last turn differently)."""

    def __init__(self, reach: int) -> None:
        super().__init__()
        self.reach = reach

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        ids = sim_tok.chat_token_ids(messages, add_generation_prompt)
        if not add_generation_prompt:
            ids[-self.reach :] = [250 - (i % 7) for i in range(min(self.reach, len(ids)))]
        return ids


class FakeRewritingTemplate(SimSource):
    """A FAKE chat template that is not prefix-preserving at all: it writes the number of messages into the
    system prompt (as templates that move or rewrite earlier turns do), so every longer conversation's ids
    differ from its history's at the start."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        return [100 + len(messages), *sim_tok.chat_token_ids(messages, add_generation_prompt)]


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1 << 20):x}" for _ in range(n))


def conversation(rng: random.Random, turns: int, system: str | None = None) -> list[list[dict[str, str]]]:
    """The message lists of each turn of one conversation (each turn: the history, a reply, a new question)."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": system or words(rng, 300)}]
    out = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": words(rng, rng.randrange(20, 80))})
        out.append([dict(m) for m in msgs])
        msgs.append({"role": "assistant", "content": words(rng, rng.randrange(20, 80))})
    return out


def full_keys(ids: Sequence[int]) -> list[int]:
    return request_block_keys(ids, BS, MODEL)


def cached(**kw: Any) -> CachedTokenizer:
    args: dict[str, Any] = {
        "max_bytes": 8 << 20,
        "block_size": BS,
        "max_tokens": 16_384,
        "min_fraction": 0.5,
        "trust_after": 2,
        "queue_size": 64,
        "queue_max_bytes": 8 << 20,
        "fill_timeout_s": 30.0,
    }
    args.update(kw)
    return CachedTokenizer(**args)


async def run_turns(
    ct: CachedTokenizer, src: SimSource, turns: list[list[dict[str, str]]]
) -> list[tuple[str, int, list[int], list[int]]]:
    """Each turn through the cache, the fills drained between turns (a reply takes longer than a fill):
    (how, request-path calls, keys returned, keys of the full tokenization)."""
    out = []
    for msgs in turns:
        before = src.request_calls()
        got = await ct.resolve(src.token_ids, MODEL, msgs, None, ROOT, 30.0)
        assert got is not None
        await ct.drained()
        out.append((got.how, src.request_calls() - before, list(got.keys), full_keys(src.render(msgs, True))))
    return out


@pytest.fixture
async def fills() -> Any:
    """Starts fill workers for a CachedTokenizer and stops them after the test."""
    tasks: list[asyncio.Task[None]] = []

    def start(ct: CachedTokenizer, src: SimSource, workers: int = 2) -> None:
        tasks.append(asyncio.create_task(ct.run_fills(lambda: src, workers)))

    yield start
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- correctness ------------------------------------------------------------------------------------------
async def test_cached_prefix_keys_equal_a_full_tokenizations_keys(fills: Any) -> None:
    """The simulator's tokenizer, 12 conversations of 6 turns: every key the cache returns is the key of the
    same block of the full prompt's tokenization, and once the model is trusted later turns need no call."""
    rng = random.Random(7)
    src = SimSource()
    ct = cached()
    fills(ct, src)
    prefix_turns = 0
    for _ in range(12):
        for how, calls, keys, full in await run_turns(ct, src, conversation(rng, 6)):
            assert keys == full[: len(keys)], how  # never a wrong key
            if how == "prefix":
                prefix_turns += 1
                assert calls == 0
                assert len(keys) >= len(full) // 2  # the history is keyed, not only the system prompt
            else:
                assert calls == 1 and keys == full
    assert prefix_turns >= 12 * 4  # after the first confirmations every second-or-later turn
    assert ct.count("checks", "mismatch") == 0
    assert ct.count("checks", "confirmed") >= 2


async def test_prompt_tokens_estimate_and_exactness(fills: Any) -> None:
    rng = random.Random(3)
    src = SimSource()
    ct = cached(trust_after=0)
    fills(ct, src)
    turns = conversation(rng, 4)
    for i, msgs in enumerate(turns):
        got = await ct.resolve(src.token_ids, MODEL, msgs, None, ROOT, 30.0)
        assert got is not None
        true = len(src.render(msgs, True))
        if i == 0:
            assert got.exact and got.prompt_tokens == true and got.how == "miss"
        else:
            assert not got.exact and got.how == "prefix"
            assert abs(got.prompt_tokens - true) <= 0.25 * true  # the history's count + the rest by its ratio
        await ct.drained()
    # the same request again: its whole prompt is cached, exact, no call
    calls = len(src.calls)
    again = await ct.resolve(src.token_ids, MODEL, turns[0], None, ROOT, 30.0)
    assert again is not None and again.exact and again.how == "exact" and len(src.calls) == calls
    assert list(again.keys) == full_keys(src.render(turns[0], True))


async def test_safety_margin_keeps_keys_right_when_the_boundary_merges(fills: Any) -> None:
    """FAKE merging tokenizer: the last 16 ids of a rendering change when more follows. The margin (the
    partial block and one more) drops them: every key still equals the full tokenization's, no check fails."""
    rng = random.Random(11)
    src = FakeMergingTokenizer(reach=BS)
    ct = cached()
    fills(ct, src)
    used = 0
    for _ in range(6):
        for how, _calls, keys, full in await run_turns(ct, src, conversation(rng, 5)):
            assert keys == full[: len(keys)]
            used += how == "prefix"
    assert used > 0
    assert ct.count("checks", "mismatch") == 0


async def test_a_template_that_is_not_prefix_preserving_is_refused(fills: Any) -> None:
    """FAKE rewriting template: the first check fails, the model's cached prefixes are refused for good, and
    no request is ever keyed from one (each key equals the full tokenization's)."""
    rng = random.Random(5)
    src = FakeRewritingTemplate()
    ct = cached()
    fills(ct, src)
    for _ in range(4):
        for how, calls, keys, full in await run_turns(ct, src, conversation(rng, 4)):
            assert how == "miss" and calls == 1
            assert keys == full
    assert ct.count("checks", "mismatch") >= 1
    assert MODEL in ct.refused and not ct.trusted(MODEL)
    assert ct.count("checks", "confirmed") == 0


async def test_margin_too_small_for_the_merge_is_caught_by_the_check(fills: Any) -> None:
    """FAKE merging tokenizer reaching 40 ids back (more than the margin): the check refuses the model before
    it is trusted, so no request is keyed from a wrong prefix."""
    rng = random.Random(13)
    src = FakeMergingTokenizer(reach=40)
    ct = cached()
    fills(ct, src)
    for _ in range(3):
        for how, _calls, keys, full in await run_turns(ct, src, conversation(rng, 4)):
            assert how == "miss" and keys == full
    assert MODEL in ct.refused


async def test_shared_system_prompt_is_cached_across_conversations(fills: Any) -> None:
    """A system prompt seen in two conversations is tokenized alone (k=1); a third conversation's first turn
    is keyed from it without a call."""
    rng = random.Random(17)
    system = words(rng, 600)
    src = SimSource()
    ct = cached(trust_after=0)
    fills(ct, src)
    for _ in range(2):
        await run_turns(ct, src, conversation(rng, 1, system))
    (how, calls, keys, full), *_ = await run_turns(ct, src, conversation(rng, 1, system))
    assert how == "prefix" and calls == 0
    assert keys == full[: len(keys)] and len(keys) == safe_length(len(sim_tok.encode(system)) + 2, BS) // BS


async def test_completions_prompts_share_cut_prefixes(fills: Any) -> None:
    """Completions strings: content-defined cuts, a prefix seen twice is tokenized, the third prompt with it
    is keyed from the cache; every key equals the full tokenization's."""
    rng = random.Random(19)
    shared = words(rng, 3000)
    src = SimSource()
    ct = cached(trust_after=0)
    fills(ct, src)
    hows = []
    for _ in range(4):
        prompt = shared + " " + words(rng, 300)
        got = await ct.resolve(src.token_ids, MODEL, None, prompt, ROOT, 30.0)
        assert got is not None
        full = full_keys(sim_tok.encode(prompt))
        assert list(got.keys) == full[: len(got.keys)]
        hows.append(got.how)
        await ct.drained()
    assert hows[:2] == ["miss", "miss"] and hows[2:] == ["prefix", "prefix"]


def test_prompt_cuts_depend_only_on_the_text_before_them() -> None:
    rng = random.Random(23)
    a = words(rng, 2000)
    b = a[:5000] + "x" * 3 + words(rng, 1000)
    ca, cb = prompt_cuts(a, 1024), prompt_cuts(b, 1024)
    shared = [c for c in ca if c < 4096]  # cuts whose window lies inside the shared 5,000 characters
    assert shared and cb[: len(shared)] == shared
    assert all(a[c] == " " for c in ca) and ca == sorted(set(ca))
    assert prompt_cuts("x" * 10_000, 1024) == []  # no whitespace: no cut


# -- keys cannot collide by construction ---------------------------------------------------------------
def test_keys_are_injective() -> None:
    m = [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]
    shifted = [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]
    merged = [{"role": "user", "content": "abc"}]
    swapped = [{"role": "ab", "content": "user"}, {"role": "user", "content": "c"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}]}, {"role": "user", "content": "c"}]
    variants = [m, shifted, merged, swapped, parts]
    exact = {chat_segments(MODEL, v).exact_key for v in variants}
    assert len(exact) == len(variants)
    # the same messages under another model, or as a completions prompt, are other keys
    assert chat_segments("other", m).exact_key != chat_segments(MODEL, m).exact_key
    assert root_digest("chat", MODEL) != root_digest("prompt", MODEL)
    # a point key is never an exact key, and key order inside a message does not matter (canonical JSON)
    seg = chat_segments(MODEL, m)
    assert seg.exact_key not in seg.keys
    reordered = [{"content": "ab", "role": "user"}, {"content": "c", "role": "user"}]
    assert chat_segments(MODEL, reordered).keys == seg.keys
    # length-framed segments: moving bytes between segments changes every later digest
    d0 = root_digest("prompt", MODEL)
    assert chain_digest(chain_digest(d0, b"ab"), b"c") != chain_digest(chain_digest(d0, b"a"), b"bc")
    assert chain_digest(d0, b"abc") != chain_digest(chain_digest(d0, b"ab"), b"c")
    p = prompt_segments(MODEL, "ab c")
    assert p.exact_key != chat_segments(MODEL, [{"role": "user", "content": "ab c"}]).exact_key


# -- bounds -------------------------------------------------------------------------------------------------
def test_cache_is_bounded_by_bytes_with_lru_eviction() -> None:
    cache = TokenCache(max_bytes=4 * (ENTRY_OVERHEAD + 64 * 4), block_size=BS, max_tokens=1024)
    keys = [bytes([i]) * 32 for i in range(6)]
    for k in keys[:4]:
        cache.put(k, Entry(bytes(64 * 4), 64, 100, exact=False))
    assert cache.entries == 4 and cache.bytes <= cache.max_bytes
    cache.get(keys[0])  # now the most recently used
    cache.put(keys[4], Entry(bytes(64 * 4), 64, 100, exact=False))
    assert keys[1] not in cache and keys[0] in cache  # the least recently used went
    for i in range(50):  # markers count against the same budget
        cache.mark(bytes([100 + i]) * 32)
        assert cache.bytes <= cache.max_bytes
    assert cache.bytes == sum(
        MARKER_COST if e is None else e.cost
        for e in cache._items.values()  # the books match what is held
    )
    # ids beyond max_tokens are not kept; an entry larger than the whole budget is not stored
    big = Entry(bytes(5000 * 4), 5000, 1, exact=True)
    cache.put(b"big" * 11, big)
    assert len(big.packed) == 1024 * 4 or b"big" * 11 not in cache
    tiny = TokenCache(max_bytes=100, block_size=BS, max_tokens=1024)
    tiny.put(b"k" * 32, Entry(bytes(64), 16, 1, exact=True))
    assert len(tiny) == 0 and tiny.bytes == 0


def test_memoised_keys_are_booked() -> None:
    cache = TokenCache(max_bytes=1 << 20, block_size=BS, max_tokens=1024)
    ids = list(range(100, 100 + 64))
    e = Entry(bytes(0), 0, 1, exact=True)
    e.packed = __import__("array").array("I", ids).tobytes()
    cache.put(b"k" * 32, e)
    before = cache.bytes
    keys = cache.keys_of(b"k" * 32, e, ROOT, 1024)
    assert list(keys) == full_keys(ids)
    assert cache.bytes == before + 8 * len(keys)
    assert cache.keys_of(b"k" * 32, e, ROOT, 1024) is keys  # memoised for this root
    other = root_key(MODEL, None, "salt")
    assert list(cache.keys_of(b"k" * 32, e, other, 1024)) == request_block_keys(ids, BS, MODEL, None, "salt")


async def test_full_fill_queue_drops_and_counts() -> None:
    """No workers run: the queue holds its bound, the rest is dropped and counted; duplicates are not queued."""
    rng = random.Random(29)
    src = SimSource()
    ct = cached(queue_size=2)
    for _ in range(5):
        await ct.resolve(src.token_ids, MODEL, conversation(rng, 1)[0], None, ROOT, 30.0)
    assert ct._queue.qsize() == 2
    assert ct.count("fills", "dropped") == 3
    same = conversation(random.Random(31), 1)[0]
    ct2 = cached(queue_size=2)
    for _ in range(3):
        await ct2.resolve(src.token_ids, MODEL, same, None, ROOT, 30.0)
    # the whole message list, and (seen before) the system prompt alone; the third time adds nothing
    assert ct2._queue.qsize() == 2 and ct2.count("fills", "dropped") == 0 and len(ct2.pending) == 2
    # the byte bound: a fill larger than queue_max_bytes is dropped too
    ct3 = cached(queue_max_bytes=1024)
    await ct3.resolve(src.token_ids, MODEL, conversation(rng, 1)[0], None, ROOT, 30.0)
    assert ct3._queue.qsize() == 0 and ct3.count("fills", "dropped") == 1


async def test_disabled_cache_calls_the_tokenizer_every_time() -> None:
    src = SimSource()
    ct = cached(max_bytes=0)
    msgs = conversation(random.Random(37), 1)[0]
    for _ in range(3):
        got = await ct.resolve(src.token_ids, MODEL, msgs, None, ROOT, 30.0)
        assert got is not None and got.exact
    assert src.request_calls() == 3 and ct._queue.qsize() == 0


async def test_a_failed_call_falls_back_on_a_cached_prefix(fills: Any) -> None:
    """A trusted prefix that covers too little to skip the call is still used when the call fails."""
    rng = random.Random(41)
    src = SimSource()
    ct = cached(trust_after=0, min_fraction=1.0)
    fills(ct, src)
    turns = conversation(rng, 2)
    await run_turns(ct, src, turns[:1])

    async def failing(model: str, messages: Any = None, prompt: Any = None, **kw: Any) -> list[int] | None:
        return None

    got = await ct.resolve(failing, MODEL, turns[1], None, ROOT, 30.0)
    assert got is not None and got.how == "prefix_after_failure" and not got.exact
    full = full_keys(src.render(turns[1], True))
    assert list(got.keys) == full[: len(got.keys)] and got.keys


# -- Tier 4 -------------------------------------------------------------------------------------------------
def chat_facts(messages: list[dict[str, str]]) -> RequestFacts:
    import orjson

    return parse_request(
        orjson.dumps({"model": MODEL, "messages": messages}), "/v1/chat/completions", max_body_bytes=8 << 20
    )


def tier4(**tok: Any) -> Tier4:
    cfg = KvCacheIndexConfig(enabled=True, tokenizer=TokenizerConfig(**tok))
    return Tier4(cfg, Pool(PoolConfig()), PickerMetrics())


def test_timeout_scales_with_the_body() -> None:
    t4 = tier4()
    assert t4.timeout_s(0) == pytest.approx(0.050)
    assert t4.timeout_s(220_000) == pytest.approx(0.050 + 220_000 / 1024 * 0.001)
    assert t4.timeout_s(8 << 20) == pytest.approx(1.0)  # capped
    assert tier4(timeout_ms=5000).timeout_s(0) == pytest.approx(5.0)  # an older, larger timeout_ms still counts


async def test_tier4_held_carries_estimate_and_exactness() -> None:
    rng = random.Random(43)
    t4 = tier4(cache_trust_after=0, timeout_ms=10_000, timeout_max_ms=10_000)
    src = SimSource()
    t4.tokenizer = src
    seen_timeouts: list[float] = []
    real = t4.tokens.resolve

    async def spy(tokenize: Any, model: str, messages: Any, prompt: Any, root: int, timeout_s: float) -> Any:
        seen_timeouts.append(timeout_s)
        return await real(tokenize, model, messages, prompt, root, timeout_s)

    t4.tokens.resolve = spy  # type: ignore[method-assign]
    worker = asyncio.create_task(t4.run_fills())
    try:
        turns = conversation(rng, 3)
        first = await t4.lookup(chat_facts(turns[0]))
        assert first.exact is True
        assert first.prompt_tokens == len(src.render(turns[0], True))
        await t4.tokens.drained()
        second = await t4.lookup(chat_facts(turns[1]))
        assert second.exact is False
        assert (second.prompt_tokens or 0) > 0
        assert src.request_calls() == 1
        f = chat_facts(turns[1])
        assert seen_timeouts[-1] == pytest.approx(t4.timeout_s(f.body_bytes)) and f.body_bytes > 0
        # token ids as sent: exact, no call
        ids = parse_request(
            b'{"model":"sim-model","prompt":[' + b",".join(b"7" for _ in range(40)) + b"]}",
            "/v1/completions",
            max_body_bytes=1 << 20,
        )
        held = await t4.lookup(ids)
        assert held.exact is True and held.prompt_tokens == 40
        assert src.request_calls() == 1
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    assert t4.metrics.registry.get_sample_value("continuum_kv_token_cache_lookups_total", {"result": "prefix"}) == 1
    assert t4.metrics.registry.get_sample_value("continuum_kv_tokenize_calls_total", {"path": "request"}) == 1
    assert (t4.metrics.registry.get_sample_value("continuum_kv_token_cache_bytes") or 0) > 0


async def test_local_tokenizer_works_with_the_cache_off_the_event_loop(tmp_path: Any) -> None:
    """A real tokenizer.json (word-level) and a chat template: the second turn is keyed from the cache, and
    every encode ran in a worker thread, never on the event loop's thread."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from picker.kv.tokenizer_sources import LocalTokenizer

    rng = random.Random(47)
    turns = conversation(rng, 3)
    vocab: dict[str, int] = {"[UNK]": 0, "<|system|>": 1, "<|user|>": 2, "<|assistant|>": 3, "<|end|>": 5}
    for msgs in turns:
        for m in msgs:
            for w in m["content"].split():
                vocab.setdefault(w, len(vocab) + 10)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    local = LocalTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"), timeout_ms=30_000)
    threads: list[int] = []
    encode = local._encode

    def recording(*a: Any) -> list[int]:
        threads.append(threading.get_ident())
        return encode(*a)

    local._encode = recording  # type: ignore[method-assign]
    ct = cached(trust_after=0)
    worker = asyncio.create_task(ct.run_fills(lambda: local, 1))
    try:
        hows = []
        for msgs in turns:
            got = await ct.resolve(local.token_ids, MODEL, msgs, None, ROOT, 30.0)
            assert got is not None
            full = await local.token_ids(MODEL, messages=msgs)
            assert full is not None and list(got.keys) == full_keys(full)[: len(got.keys)]
            hows.append(got.how)
            await ct.drained()
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await local.close()
    assert hows == ["miss", "prefix", "prefix"]
    assert threads and threading.get_ident() not in threads


def test_a_check_that_compares_nothing_confirms_nothing_and_a_shorter_rendering_is_a_mismatch() -> None:
    from picker.kv.token_cache import Entry, _pack

    ct = cached()
    ct.cache.put(b"tiny", Entry(_pack([1, 2, 3]), 3, 10, exact=False))  # under one block: nothing to compare
    assert ct._check(MODEL, b"tiny", _pack(list(range(64))))
    assert ct.trust.get(MODEL, 0) == 0
    ct.cache.put(b"long", Entry(_pack(list(range(32))), 40, 100, exact=False))
    assert ct._check(MODEL, b"long", _pack(list(range(48))))  # a real prefix: one confirmation
    assert ct.trust[MODEL] == 1
    # a later rendering shorter than the cached prefix (the template dropped earlier content): refused
    assert not ct._check(MODEL, b"long", _pack(list(range(20))))
    assert MODEL in ct.refused
