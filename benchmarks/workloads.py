"""Workload generators: each returns a list of ``TraceRecord`` (see ``benchmarks.trace``).

Lengths are in tokens of the simulator's tokenizer (``benchmarks.engine_sim.tokenizer``), where one
whitespace-separated word is one token; random text is drawn from a fixed table of pseudo-words, so
every generator is deterministic for a given ``seed``.

- ``prefix_repetition``: vLLM's ``prefix_repetition`` dataset semantics: ``num_prefixes`` random
  prefixes of ``prefix_len`` tokens, each followed by ``prompts_per_prefix`` random suffixes of
  ``suffix_len`` tokens; ``output_len`` output tokens; shuffled with the seed. Completions requests by
  default (the prompt is exactly prefix + suffix tokens).
- ``shared_prefix_groups``: chat requests in groups sharing a system prompt, each with its own question.
- ``multi_turn_chat``: sessions of 3–8 turns; each turn's messages are the previous turn's messages, the
  assistant reply to it, and a new user message; the system prompt of a session is drawn with the given
  popularity weights. Turn k of a session has ``t = start + k * turn_gap_s`` as its earliest time; the
  load generator also waits for turn k-1 to finish.
- ``chat_skew``: scenario S2's traffic: 64 system prompts of 2–6k tokens with Zipf(1.1) popularity,
  multi-turn sessions, Poisson session starts, optionally a linear rate ramp.
- ``hot_documents``: RAG over a few hot documents: each request is one chat turn whose system message
  is one of ``num_docs`` long documents (popularity Zipf(``zipf_s``) over the documents) and whose
  user message is a short question of its own; Poisson arrivals.

Arrivals: ``poisson_arrivals(n, rate)`` and ``ramp_arrivals(n, start_rate, end_rate)`` (a
non-homogeneous Poisson process whose rate grows linearly from start to end).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from benchmarks.trace import CHAT_PATH, COMPLETIONS_PATH, TraceRecord

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _pseudo_words(count: int = 8192) -> tuple[str, ...]:
    rng = random.Random(1234)  # fixed table, independent of any workload seed
    words: set[str] = set()
    while len(words) < count:
        n = rng.randint(2, 4)
        words.add("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n)))
    return tuple(sorted(words))


WORDS: tuple[str, ...] = _pseudo_words()


def random_text(rng: random.Random, n_tokens: int) -> str:
    """``n_tokens`` random words (exactly ``n_tokens`` simulator tokens)."""
    return " ".join(rng.choices(WORDS, k=n_tokens))


# -- arrivals ---------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets (s) of ``n`` requests of a Poisson process at ``rate``/s (inf or 0: all at 0)."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    t = 0.0
    out: list[float] = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def ramp_arrivals(n: int, start_rate: float, end_rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets of ``n`` requests whose Poisson rate ramps linearly from start to end.

    The ramp lasts ``T = 2n / (start_rate + end_rate)`` (the expected time of the n-th arrival);
    arrivals past ``T`` continue at ``end_rate``.
    """
    if start_rate <= 0 or end_rate <= 0:
        raise ValueError("ramp rates must be positive")
    duration = 2 * n / (start_rate + end_rate)
    slope = (end_rate - start_rate) / duration  # d(rate)/dt
    total_in_ramp = start_rate * duration + slope * duration**2 / 2
    s = 0.0
    out: list[float] = []
    for _ in range(n):
        s += rng.expovariate(1.0)  # unit-rate process, mapped through the inverse cumulative rate
        if s > total_in_ramp:
            out.append(duration + (s - total_in_ramp) / end_rate)
        elif abs(slope) < 1e-12:
            out.append(s / start_rate)
        else:
            out.append((-start_rate + math.sqrt(start_rate**2 + 2 * slope * s)) / slope)
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf popularity of ranks 1..n with exponent ``s``."""
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _sampling(model: str, output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# -- generators -------------------------------------------------------------------------------------
def prefix_repetition(
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int,
    prompts_per_prefix: int,
    rate: float = math.inf,
    seed: int = 0,
    shuffle: bool = True,
    model: str = "sim-model",
    path: str = COMPLETIONS_PATH,
) -> list[TraceRecord]:
    """vLLM's prefix-repetition workload (see the module docstring); Poisson arrivals at ``rate``."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for _ in range(num_prefixes):
        prefix = random_text(rng, prefix_len)
        for _ in range(prompts_per_prefix):
            suffix = random_text(rng, suffix_len)
            prompts.append(f"{prefix} {suffix}" if prefix and suffix else prefix or suffix)
    if shuffle:
        rng.shuffle(prompts)
    times = poisson_arrivals(len(prompts), rate, rng)
    records: list[TraceRecord] = []
    for t, prompt in zip(times, prompts, strict=True):
        if path == CHAT_PATH:
            body = {"messages": [{"role": "user", "content": prompt}], **_sampling(model, output_len)}
        else:
            body = {"prompt": prompt, **_sampling(model, output_len)}
        records.append(TraceRecord(t, path, body))
    return records


def shared_prefix_groups(
    num_groups: int,
    prompts_per_group: int,
    shared_len: int,
    unique_len: int,
    output_len: int,
    rate: float = math.inf,
    seed: int = 0,
    model: str = "sim-model",
) -> list[TraceRecord]:
    """Chat requests in ``num_groups`` groups; a group shares its system prompt; order shuffled."""
    rng = random.Random(seed)
    systems = [random_text(rng, shared_len) for _ in range(num_groups)]
    pairs = [(g, random_text(rng, unique_len)) for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(pairs)
    times = poisson_arrivals(len(pairs), rate, rng)
    records: list[TraceRecord] = []
    for t, (group, question) in zip(times, pairs, strict=True):
        messages = [{"role": "system", "content": systems[group]}, {"role": "user", "content": question}]
        records.append(
            TraceRecord(t, CHAT_PATH, {"messages": messages, **_sampling(model, output_len)}, extra={"group": group})
        )
    return records


def multi_turn_chat(
    num_sessions: int,
    system_prompts: Sequence[str],
    popularity: Sequence[float] | None = None,
    turns: tuple[int, int] = (3, 8),
    user_len: int = 64,
    output_len: int = 128,
    session_starts: Sequence[float] | None = None,
    session_rate: float = 1.0,
    turn_gap_s: float = 1.0,
    seed: int = 0,
    model: str = "sim-model",
) -> list[TraceRecord]:
    """Multi-turn chat sessions with growing history (see the module docstring).

    ``session_starts`` overrides the Poisson session starts at ``session_rate``. The assistant reply
    appended to the history is ``output_len`` random words, so history lengths match the output length.
    """
    rng = random.Random(seed)
    starts = list(session_starts) if session_starts is not None else poisson_arrivals(num_sessions, session_rate, rng)
    if len(starts) != num_sessions:
        raise ValueError("session_starts must have num_sessions entries")
    records: list[TraceRecord] = []
    indices = range(len(system_prompts))
    for s, start in enumerate(starts):
        prompt_index = rng.choices(indices, weights=popularity, k=1)[0] if popularity else rng.choice(indices)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompts[prompt_index]}]
        for turn in range(rng.randint(*turns)):
            messages.append({"role": "user", "content": random_text(rng, user_len)})
            body = {"messages": [dict(m) for m in messages], **_sampling(model, output_len)}
            records.append(
                TraceRecord(
                    start + turn * turn_gap_s,
                    CHAT_PATH,
                    body,
                    session=f"s{s}",
                    turn=turn,
                    extra={"system_prompt": prompt_index},
                )
            )
            messages.append({"role": "assistant", "content": random_text(rng, output_len)})
    records.sort(key=lambda r: r.t)
    return records


def chat_skew(
    num_sessions: int = 200,
    num_system_prompts: int = 64,
    system_len: tuple[int, int] = (2000, 6000),
    zipf_s: float = 1.1,
    turns: tuple[int, int] = (3, 8),
    user_len: int = 64,
    output_len: int = 128,
    session_rate: float = 1.0,
    ramp_to_rate: float | None = None,
    turn_gap_s: float = 1.0,
    seed: int = 0,
    model: str = "sim-model",
) -> list[TraceRecord]:
    """Scenario S2's traffic: Zipf-popular long system prompts, multi-turn sessions, optional ramp
    of the session start rate from ``session_rate`` to ``ramp_to_rate``."""
    rng = random.Random(seed)
    systems = [random_text(rng, rng.randint(*system_len)) for _ in range(num_system_prompts)]
    if ramp_to_rate is None:
        starts = poisson_arrivals(num_sessions, session_rate, rng)
    else:
        starts = ramp_arrivals(num_sessions, session_rate, ramp_to_rate, rng)
    return multi_turn_chat(
        num_sessions,
        systems,
        zipf_weights(num_system_prompts, zipf_s),
        turns,
        user_len,
        output_len,
        session_starts=starts,
        turn_gap_s=turn_gap_s,
        seed=rng.randrange(2**32),
        model=model,
    )


def hot_documents(
    num_requests: int = 600,
    num_docs: int = 4,
    doc_len: tuple[int, int] = (3000, 6000),
    zipf_s: float = 1.2,
    question_len: tuple[int, int] = (24, 48),
    output_len: int = 64,
    rate: float = 12.0,
    seed: int = 0,
    model: str = "sim-model",
) -> list[TraceRecord]:
    """RAG over a few hot documents (see the module docstring): ``num_requests`` single-turn chat
    requests, document ``d`` (rank ``d``, 0 the hottest) drawn with Zipf(``zipf_s``) weights, a unique
    random question of ``question_len`` tokens, Poisson arrivals at ``rate``. ``extra["doc"]`` is the
    document's rank."""
    rng = random.Random(seed)
    docs = [random_text(rng, rng.randint(*doc_len)) for _ in range(num_docs)]
    weights = zipf_weights(num_docs, zipf_s)
    choices = rng.choices(range(num_docs), weights=weights, k=num_requests)
    times = poisson_arrivals(num_requests, rate, rng)
    records: list[TraceRecord] = []
    for t, doc in zip(times, choices, strict=True):
        question = random_text(rng, rng.randint(*question_len))
        messages = [{"role": "system", "content": docs[doc]}, {"role": "user", "content": question}]
        records.append(
            TraceRecord(t, CHAT_PATH, {"messages": messages, **_sampling(model, output_len)}, extra={"doc": doc})
        )
    return records
