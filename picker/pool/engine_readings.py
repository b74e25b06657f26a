"""What an engine's ``/metrics`` say of its queue and KV cache (``engine_signals``: vLLM's and SGLang's families,
mirror labels collapsed, separate queues added, KV usage averaged), of its measured prefill cost
(``prefill_totals``, vLLM's prefill histograms) and of its LoRA slots (``lora_load``, vLLM's
``lora_requests_info``). See docs/picker.md, "Engine signals", and docs/llm-d-compat.md, "LoRA".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from picker.pool.exposition import Exposition, Sample, largest_sample, parse_exposition
from picker.routing.endpoints import EngineSignals
from picker.routing.served_models import LoraLoad

VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the name before vLLM 0.9 (deprecated, hidden since 0.10)
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"
# (waiting, running, kv usage names in order of preference), tried in this order
ENGINE_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (VLLM_WAITING, VLLM_RUNNING, (VLLM_KV_USAGE, VLLM_KV_USAGE_OLD)),
    (SGLANG_WAITING, SGLANG_RUNNING, (SGLANG_KV_USAGE,)),
)
# vLLM's per-request prefill records (observed when a request finishes): their sums and counts teach the cost
# model the engine's prefill cost per computed token (``picker.pool.calibration.EnginePrefillFit``)
VLLM_PREFILL_COUNT = "vllm:request_prefill_time_seconds_count"
VLLM_PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
VLLM_PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens_sum"
VLLM_PREFILL_TOKENS_COUNT = "vllm:request_prefill_kv_computed_tokens_count"
PREFILL_FAMILIES = (VLLM_PREFILL_COUNT, VLLM_PREFILL_SECONDS, VLLM_PREFILL_TOKENS, VLLM_PREFILL_TOKENS_COUNT)
# the engine's preemptions so far (a counter): the experiments' preemption windows (``picker.pool.preemptions``)
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
WANTED_FAMILIES = frozenset(
    (*(n for w, r, kv in ENGINE_FAMILIES for n in (w, r, *kv)), *PREFILL_FAMILIES, VLLM_PREEMPTIONS)
)
# vLLM's LoRA slots: a gauge whose labels are the state (max_lora, running_lora_adapters, waiting_lora_adapters: comma
# lists) and whose value is the time it was set; every label set ever seen stays in the body, so the current state
# is the sample with the largest value. Read apart from the wanted families (``largest_sample``, one kept).
VLLM_LORA_INFO = "vllm:lora_requests_info"
MAX_LORA_ADAPTERS = 256  # adapter names kept per label (running, waiting); more are ignored
MAX_LORA_SLOTS = 100_000  # a max_lora beyond this is not a reading
# Labels that tell apart reports of ONE scheduler (docs/picker.md, "Engine signals"): series differing only in these
# are the same queue seen twice; the largest is taken.
MIRROR_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "pid"})
MAX_COUNT = 1e9


def _per_queue(samples: list[Sample]) -> list[float]:
    """One value per queue: series keyed by their labels without the mirror labels, the largest per key."""
    queues: dict[tuple[tuple[str, str], ...], float] = {}
    for s in samples:
        key = tuple(kv for kv in s.labels if kv[0] not in MIRROR_LABELS)
        prev = queues.get(key)
        queues[key] = s.value if prev is None or s.value > prev else prev
    return list(queues.values())


def _count(samples: list[Sample]) -> int | None:
    """Sum over queues of a request count; None when absent or any value is not a count."""
    if not samples or any(not (0.0 <= s.value <= MAX_COUNT) for s in samples):  # NaN fails the comparison too
        return None
    return round(sum(_per_queue(samples)))


def _usage(samples: list[Sample]) -> float | None:
    """Mean over queues of a 0..1 usage; None when absent or any value is outside 0..1 (NaN included)."""
    if not samples or any(not (0.0 <= s.value <= 1.0) for s in samples):
        return None
    values = _per_queue(samples)
    return math.fsum(values) / len(values)


def engine_signals(expo: Exposition) -> EngineSignals | None:
    """The engine's queue and KV usage from a parsed body (vLLM first, then SGLang); None: no valid reading."""
    by_name: dict[str, list[Sample]] = {}
    for s in expo.samples:
        by_name.setdefault(s.name, []).append(s)
    for waiting_name, running_name, usage_names in ENGINE_FAMILIES:
        waiting_samples, running_samples = by_name.get(waiting_name), by_name.get(running_name)
        if not waiting_samples and not running_samples:
            continue
        waiting = _count(waiting_samples or [])
        running = _count(running_samples or [])
        if waiting is None or running is None:
            return None  # the engine's names are there but not both valid: no reading
        usage = next((u for n in usage_names if (u := _usage(by_name.get(n, []))) is not None), None)
        return EngineSignals(waiting=waiting, running=running, kv_usage=usage)
    return None


@dataclass(slots=True, frozen=True)
class PrefillTotals:
    """An engine's cumulative prefill records: finished requests, their prefill seconds and computed tokens."""

    requests: float
    seconds: float
    tokens: float

    def since(self, earlier: PrefillTotals) -> PrefillTotals | None:
        """The requests recorded between ``earlier`` and this reading; None when a counter went back (a
        restarted engine: the caller starts over from this reading)."""
        d = PrefillTotals(
            self.requests - earlier.requests, self.seconds - earlier.seconds, self.tokens - earlier.tokens
        )
        return d if min(d.requests, d.seconds, d.tokens) >= 0.0 else None


def prefill_totals(expo: Exposition) -> PrefillTotals | None:
    """vLLM's prefill sums and counts, summed over its engines (mirror series once); None when any is absent
    or not a finite count, or the two histograms counted different requests (a reading taken mid-update)."""
    values: list[float] = []
    for name in PREFILL_FAMILIES:
        samples = expo.family(name)
        if not samples or any(not (0.0 <= s.value < 1e15) for s in samples):
            return None
        values.append(math.fsum(_per_queue(samples)))
    requests, seconds, tokens, token_requests = values
    return PrefillTotals(requests, seconds, tokens) if requests == token_requests else None


def preemption_total(expo: Exposition) -> float | None:
    """vLLM's preemptions so far, summed over its engines (mirror series once); None when absent or not a count."""
    samples = expo.family(VLLM_PREEMPTIONS)
    if not samples or any(not (0.0 <= s.value < 1e15) for s in samples):
        return None
    return math.fsum(_per_queue(samples))


def _adapters(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    names = (a.strip() for a in value.split(",", MAX_LORA_ADAPTERS)[:MAX_LORA_ADAPTERS])
    return frozenset(a for a in names if a)


def lora_load(text: str) -> LoraLoad | None:
    """vLLM's LoRA slots from its most recent ``lora_requests_info`` sample; None when the engine does not report
    them (no LoRA, not vLLM) or ``max_lora`` is not a count."""
    s = largest_sample(text, VLLM_LORA_INFO)
    if s is None:
        return None
    raw = s.label("max_lora")
    raw = raw.strip() if raw is not None else ""
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_LORA_SLOTS:
        return None
    return LoraLoad(int(raw), _adapters(s.label("running_lora_adapters")), _adapters(s.label("waiting_lora_adapters")))


def read_signals(text: str) -> tuple[EngineSignals | None, Exposition]:
    """Parse a scraped body (only the wanted families) and read the engine's signals from it, its LoRA slots
    included when it reports them."""
    expo = parse_exposition(text, WANTED_FAMILIES)
    signals = engine_signals(expo)
    if signals is not None and VLLM_LORA_INFO in text:
        lora = lora_load(text)
        if lora is not None:
            signals = replace(signals, lora=lora)
    return signals, expo
