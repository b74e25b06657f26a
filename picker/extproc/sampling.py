"""Response sampling: which responses stream their body through the picker (a rate, an opt-in header, or every
one in ``full`` mode), and the usage their last bytes show, booked against Tier 4's prediction.
See docs/picker.md, "Response sampling".
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Gauge

from picker.config import ExtProcConfig
from picker.ops.recorder import DecisionRecorder
from picker.ops.usage import usage_in
from picker.request.exchange import Exchange


def read_usage(tail: bytes) -> tuple[int, int | None] | None:
    """``(prompt_tokens, cached_tokens)`` of the last usage object in ``tail``; cached None when the server
    did not report it (unknown, not zero); None when there is no usage object."""
    u = usage_in(tail)
    return (u.prompt_tokens, u.cached_tokens) if u is not None else None


class ResponseSampling:
    """The sampling decision and the sample's figures (one per picker process: its metrics are registered once in
    ``registry``). ``extproc`` is restart-required: the rate and the header are read once."""

    def __init__(
        self, cfg: ExtProcConfig, registry: CollectorRegistry, recorder: DecisionRecorder, block_size: int
    ) -> None:
        self.rate = cfg.response_sample_rate
        self.header = cfg.response_sample_header.lower()
        # accumulated rate; a response is sampled each time it reaches 1. A random start phase: each picker
        # process samples a different one of the 1/rate interleaved subsets
        self._credit = random.random() * self.rate
        r = registry
        self.g_rate = Gauge(
            "kv_epp_response_sample_rate", "Configured fraction of responses streamed through the picker", registry=r
        )
        self.g_rate.set(self.rate)
        self.c_responses = Counter(
            "kv_epp_responses_observed",
            "Routed responses by what the picker saw: headers (status only) or sampled (body streamed through)",
            ["observed"],
            registry=r,
        )
        self.c_headers = self.c_responses.labels("headers")
        self.c_sampled = self.c_responses.labels("sampled")
        self.c_usage = Counter(
            "kv_epp_sampled_usage_tokens",
            "Usage of sampled responses that reported it: prompt tokens and cached (delivered) prompt tokens",
            ["kind"],
            registry=r,
        )
        self.c_usage_prompt = self.c_usage.labels("prompt")
        self.c_usage_cached = self.c_usage.labels("cached")
        self.c_usage_seen = Counter(
            "kv_epp_sampled_usage_responses", "Sampled responses whose usage carried cached_tokens", registry=r
        )
        # Tier 4's prediction for every decision and for the observed responses with usage is the recorder's
        # (continuum_picker_cached_tokens_total): delivered/captured on the sample calibrates the prediction
        # over all responses (a ratio estimator, far less noisy than the sample's share alone)
        self.recorder = recorder
        self.block_size = block_size  # kv_cache_index.tokenizer.block_size: restart-required

    def choose(self, opted_in: bool) -> bool:
        """Sample this response? Every opted-in request, and ``rate`` of the others, spread evenly (every
        1/rate-th response: a systematic sample follows a workload whose cache hits change over time more
        closely than random draws of the same size)."""
        if opted_in:
            return True
        self._credit += self.rate
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def headers_seen(self, sampled: bool) -> None:
        (self.c_sampled if sampled else self.c_headers).inc()

    def usage(self, tail: bytes, ex: Exchange | None = None) -> None:
        u = usage_in(tail)
        if u is None:
            return
        if ex is not None and ex.llmd is not None:  # llm-d's token families (picker.ops.llmd)
            self.recorder.llmd.usage(ex.llmd, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        if u.cached_tokens is None:
            return
        self.c_usage_seen.inc()
        self.c_usage_prompt.inc(u.prompt_tokens)
        self.c_usage_cached.inc(u.cached_tokens)
        kv = ex.kv if ex is not None else None
        if ex is not None and kv is not None:
            self.recorder.delivered(
                ex.decision.reason,
                kv.prompt_tokens,
                kv.available_cached,
                kv.predicted_cached,
                u.cached_tokens,
                self.block_size,
            )
