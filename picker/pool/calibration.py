"""The TTFT model's online fit: observed times to first byte → ``CostCoefficients``.

Each request whose prompt Tier 4 counted (tokenized, or a cached tokenized prefix plus the rest at its
tokens per byte) leaves a ``TtftSample``:
what its endpoint had to do before this request's first token — the prefill tokens (this picker's
pending prefill there, or the engine's queue × the mean request, and this request's own uncached
tokens), the requests queued there for a first token, and the requests decoding there. When its first
byte arrives the pair (sample, observed time) updates a recursive least-squares fit of

    ttft_ms = base_ms + prefill_ms_per_token * work_tokens + queue_ms_per_request * queued
                      + decode_ms_per_seq * decoding

with exponential forgetting (``FORGETTING``: the last ~500 samples weigh most), so the coefficients
follow the engines' real speed, their batch limits, the network and the proxy, with no constant tuned
per workload. A coefficient never goes below its floor (a per-token cost of at least
``MIN_PREFILL_MS_PER_TOKEN`` keeps the cached prefix worth something), and one observation's pull is
clipped to a few times the running mean absolute error (a request stalled by something the model does
not see teaches little).

Bounds: four coefficients, a 4×4 matrix and two running means; nothing grows with traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from picker.config import CostModelConfig
from picker.routing.endpoints import CostCoefficients

FORGETTING = 0.998
TOKEN_SCALE = 1000.0  # the fit works in thousands of tokens (a well-conditioned matrix)
MIN_PREFILL_MS_PER_TOKEN = 1e-4
MAX_MS = 600_000.0
# prior variances: base_ms², (ms per 1k tokens)², (ms per queued request)², (ms per decoding request)²
PRIOR_VARIANCE = (100.0**2, 1.0**2, 100.0**2, 10.0**2)
MAX_TRACE = 1e9  # the matrix is reset to the prior variance past this (windup when inputs stop varying)
N = 4


@dataclass(slots=True, frozen=True)
class TtftSample:
    """What an endpoint had to do before a request's first token, taken when the request was sent."""

    work_tokens: int  # prefill tokens ahead there, this request's own uncached tokens included
    decoding: int  # requests decoding there
    queued: int = 0  # requests there waiting for their first token (before this one)
    own_tokens: int = 0  # this request's uncached tokens (the mean turns an engine's queue into tokens)


class TtftCalibrator:
    """Recursive least squares over (1, work_tokens/1000, queued, decoding) → observed TTFT in ms."""

    def __init__(
        self,
        base_ms: float = 10.0,
        prefill_ms_per_token: float = 0.1,
        decode_ms_per_seq: float = 0.5,
        enabled: bool = True,
        queue_ms_per_request: float = 0.0,
    ) -> None:
        self.enabled = enabled
        self.priors = (base_ms, prefill_ms_per_token * TOKEN_SCALE, queue_ms_per_request, decode_ms_per_seq)
        self.theta = list(self.priors)
        self.p = _diag(PRIOR_VARIANCE)
        self.samples = 0
        self.mean_abs_error = 0.0
        self.mean_prefill_tokens = 0.0
        self.current = self._coefficients()

    @classmethod
    def from_config(cls, cfg: CostModelConfig) -> TtftCalibrator:
        return cls(cfg.prior_base_ms, cfg.prior_prefill_ms_per_token, cfg.prior_decode_ms_per_seq, cfg.calibrate)

    def observe(self, sample: TtftSample, ttft_s: float) -> None:
        y = ttft_s * 1000.0
        if not (0.0 <= y < MAX_MS):
            return
        n = self.samples
        self.mean_prefill_tokens += (sample.own_tokens - self.mean_prefill_tokens) / min(n + 1, 500)
        self.samples = n + 1
        if not self.enabled:
            self.current = self._coefficients()
            return
        phi = (1.0, sample.work_tokens / TOKEN_SCALE, float(sample.queued), float(sample.decoding))
        theta, p = self.theta, self.p
        p_phi = [sum(p[i][j] * phi[j] for j in range(N)) for i in range(N)]
        denom = FORGETTING + sum(phi[i] * p_phi[i] for i in range(N))
        gain = [v / denom for v in p_phi]
        err = y - sum(theta[i] * phi[i] for i in range(N))
        if n >= 20 and self.mean_abs_error > 0.0:  # clip one observation's pull (a stall, a GC pause)
            cap = 4.0 * self.mean_abs_error
            err = max(-cap, min(cap, err))
        self.mean_abs_error += (abs(err) - self.mean_abs_error) / min(n + 1, 200)
        for i in range(N):
            theta[i] += gain[i] * err
        floors = (0.0, MIN_PREFILL_MS_PER_TOKEN * TOKEN_SCALE, 0.0, 0.0)
        for i in range(N):
            theta[i] = min(MAX_MS, max(floors[i], theta[i]))
        for i in range(N):
            for j in range(N):
                p[i][j] = (p[i][j] - gain[i] * p_phi[j]) / FORGETTING
        if sum(p[i][i] for i in range(N)) > MAX_TRACE:
            self.p = _diag(PRIOR_VARIANCE)
        self.current = self._coefficients()

    def _coefficients(self) -> CostCoefficients:
        t = self.theta if self.enabled else list(self.priors)
        return CostCoefficients(t[0], t[1] / TOKEN_SCALE, t[3], self.mean_prefill_tokens, self.samples, t[2])


def _diag(values: tuple[float, ...]) -> list[list[float]]:
    return [[values[i] if i == j else 0.0 for j in range(len(values))] for i in range(len(values))]
