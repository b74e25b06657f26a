"""The TTFT model's online fit: observed times to first byte → ``CostCoefficients`` (ridge-regularised,
non-negative least squares), with the engines' own measured prefill cost as the prior.
See docs/picker.md, "The TTFT model's fit".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from picker.config import CostModelConfig
from picker.routing.endpoints import CostCoefficients

FORGETTING = 0.995  # per sample: the fit's memory is about 1 / (1 − 0.995) = 200 first bytes
SOLVE_EVERY = 8
PRIOR_WEIGHT = 5.0  # the priors count as this many samples' worth of evidence (ridge)
TOKEN_SCALE = 1000.0  # the fit works in thousands of tokens (a well-conditioned matrix)
MIN_PREFILL_MS_PER_TOKEN = 1e-4
MAX_MS = 600_000.0
N = 4
ENGINE_MIN_REQUESTS = 10  # finished requests before the engines' per-token cost is used as the prior
ENGINE_MIN_SPREAD_TOKENS = 64.0  # weighted standard deviation of their computed tokens (else no slope)
MAX_PREFILL_MS_PER_TOKEN = 100.0  # the configured prior's own upper bound
# typical feature magnitudes, to scale the ridge: 1, thousands of tokens, queued requests, decoding requests
FEATURE_SCALE = (1.0, 4.0, 4.0, 8.0)


@dataclass(slots=True, frozen=True)
class TtftSample:
    """What an endpoint had to do before a request's first token, taken when the request was sent."""

    work_tokens: int  # prefill tokens ahead there, this request's own uncached tokens included
    decoding: int  # requests decoding there
    queued: int = 0  # requests there waiting for their first token (before this one)
    own_tokens: int = 0  # this request's uncached tokens (a record; the mean comes from ``note_prefill``)


class EnginePrefillFit:
    """Weighted least squares of an engine's mean prefill ms over its mean computed tokens (thousands), from
    per-scrape differences of its counters; forgets like the first-byte fit (``FORGETTING`` per request)."""

    __slots__ = ("requests", "sw", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.requests = 0

    def add(self, requests: float, seconds: float, tokens: float) -> bool:
        """``requests`` finished with ``seconds`` of prefill in all and ``tokens`` computed in all; False:
        refused (not finite, negative, no request)."""
        vals = (requests, seconds, tokens)
        if not all(math.isfinite(v) and v >= 0.0 for v in vals) or requests < 1.0 or requests > 1e6:
            return False
        x = tokens / requests / TOKEN_SCALE
        y = seconds / requests * 1000.0
        if y >= MAX_MS:
            return False
        decay = FORGETTING**requests
        self.sw = decay * self.sw + requests
        self.sx = decay * self.sx + requests * x
        self.sy = decay * self.sy + requests * y
        self.sxx = decay * self.sxx + requests * x * x
        self.sxy = decay * self.sxy + requests * x * y
        self.requests += round(requests)
        return True

    def ms_per_token(self) -> float | None:
        """The fitted per-token cost, or None until enough requests with spread lengths back it."""
        if self.requests < ENGINE_MIN_REQUESTS or self.sw <= 0.0:
            return None
        mx = self.sx / self.sw
        var = self.sxx / self.sw - mx * mx
        if var <= (ENGINE_MIN_SPREAD_TOKENS / TOKEN_SCALE) ** 2:
            return None
        slope = (self.sxy / self.sw - mx * self.sy / self.sw) / var / TOKEN_SCALE
        return min(MAX_PREFILL_MS_PER_TOKEN, max(MIN_PREFILL_MS_PER_TOKEN, slope))


class TtftCalibrator:
    """Weighted ridge least squares over (1, work_tokens/1000, queued, decoding) → observed TTFT in ms."""

    def __init__(
        self,
        base_ms: float = 10.0,
        prefill_ms_per_token: float = 0.1,
        decode_ms_per_seq: float = 0.5,
        enabled: bool = True,
        queue_ms_per_request: float = 0.0,
        mean_prefill_tokens: float = 0.0,
        prior_from_engine: bool = True,
    ) -> None:
        self.enabled = enabled
        self.prior_from_engine = prior_from_engine
        self.engine = EnginePrefillFit()
        self.configured_priors = (base_ms, prefill_ms_per_token * TOKEN_SCALE, queue_ms_per_request, decode_ms_per_seq)
        self.priors = self.configured_priors
        self.floors = (0.0, MIN_PREFILL_MS_PER_TOKEN * TOKEN_SCALE, 0.0, 0.0)
        self.theta = list(self.priors)
        self.a = [[0.0] * N for _ in range(N)]  # Σ w φφᵀ
        self.c = [0.0] * N  # Σ w φ y
        self.weight = 0.0  # Σ w
        self.samples = 0
        self.requests = 0
        self.mean_abs_error = 0.0
        self.mean_prefill_tokens = float(mean_prefill_tokens)
        self.current = self._coefficients()

    @classmethod
    def from_config(cls, cfg: CostModelConfig) -> TtftCalibrator:
        return cls(
            cfg.prior_base_ms,
            cfg.prior_prefill_ms_per_token,
            cfg.prior_decode_ms_per_seq,
            cfg.calibrate,
            cfg.prior_queue_ms_per_request,
            cfg.prior_mean_prefill_tokens,
            cfg.prior_from_engine,
        )

    def observe_engine_prefill(self, requests: float, seconds: float, tokens: float) -> None:
        """An engine's requests finished since its last scrape: their prefill seconds and computed tokens."""
        if not self.engine.add(requests, seconds, tokens) or not (self.enabled and self.prior_from_engine):
            return
        measured = self.engine.ms_per_token()
        if measured is None:
            return
        b, _, q, d = self.configured_priors
        self.priors = (b, measured * TOKEN_SCALE, q, d)
        self.theta = self._solve() if self.samples else list(self.priors)
        self.current = self._coefficients()

    @property
    def prior_prefill_ms_per_token(self) -> float:
        """The per-token cost the fit is pulled toward: the engines' measured one, or the configured one."""
        return self.priors[1] / TOKEN_SCALE

    def note_prefill(self, tokens: int) -> None:
        """One routed request's uncached tokens (every request Tier 4 counted, not only the observed ones):
        their running mean turns an engine's queue length into tokens."""
        self.requests += 1
        self.mean_prefill_tokens += (tokens - self.mean_prefill_tokens) / min(self.requests, 500)

    def observe(self, sample: TtftSample, ttft_s: float) -> None:
        y = ttft_s * 1000.0
        if not (0.0 <= y < MAX_MS):
            return
        n = self.samples
        self.samples = n + 1
        if not self.enabled:
            self.current = self._coefficients()
            return
        phi = (1.0, sample.work_tokens / TOKEN_SCALE, float(sample.queued), float(sample.decoding))
        predicted = sum(t * f for t, f in zip(self.theta, phi, strict=True))
        err = y - predicted
        if n >= 20 and self.mean_abs_error > 0.0:  # clip one observation's pull (a stall, a GC pause)
            cap = 4.0 * self.mean_abs_error
            err = max(-cap, min(cap, err))
        self.mean_abs_error += (abs(err) - self.mean_abs_error) / min(n + 1, 200)
        y = predicted + err
        a, c = self.a, self.c
        for i in range(N):
            c[i] = FORGETTING * c[i] + phi[i] * y
            for j in range(N):
                a[i][j] = FORGETTING * a[i][j] + phi[i] * phi[j]
        self.weight = FORGETTING * self.weight + 1.0
        if self.samples % SOLVE_EVERY == 0 or self.samples < SOLVE_EVERY:
            self.theta = self._solve()
            self.current = self._coefficients()

    def _solve(self) -> list[float]:
        """argmin Σw(y − φθ)² + Σ ridge_i (θ_i − prior_i)², θ ≥ floors (every active set of 4 tried)."""
        ridge = [PRIOR_WEIGHT * s * s for s in FEATURE_SCALE]
        a = [[self.a[i][j] + (ridge[i] if i == j else 0.0) for j in range(N)] for i in range(N)]
        c = [self.c[i] + ridge[i] * self.priors[i] for i in range(N)]
        best: list[float] | None = None
        best_obj = float("inf")
        for mask in itertools.product((True, False), repeat=N):  # True: free, False: at its floor
            theta = list(self.floors)
            free = [i for i in range(N) if mask[i]]
            if free:
                sub = [[a[i][j] for j in free] for i in free]
                rhs = [c[i] - sum(a[i][j] * theta[j] for j in range(N) if not mask[j]) for i in free]
                x = _gauss(sub, rhs)
                if x is None or any(v < self.floors[i] for i, v in zip(free, x, strict=True)):
                    continue
                for i, v in zip(free, x, strict=True):
                    theta[i] = min(MAX_MS, v)
            obj = sum(theta[i] * a[i][j] * theta[j] for i in range(N) for j in range(N)) - 2 * sum(
                c[i] * theta[i] for i in range(N)
            )
            if obj < best_obj:
                best, best_obj = theta, obj
        return best if best is not None else list(self.priors)

    def _coefficients(self) -> CostCoefficients:
        t = self.theta if self.enabled else list(self.priors)
        return CostCoefficients(t[0], t[1] / TOKEN_SCALE, t[3], self.mean_prefill_tokens, self.samples, t[2])


def _gauss(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve m x = v (small, symmetric positive definite with the ridge); None when singular."""
    n = len(v)
    aug = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(aug[r][col]))
        if abs(aug[piv][col]) < 1e-12:
            return None
        aug[col], aug[piv] = aug[piv], aug[col]
        for r in range(n):
            if r != col:
                f = aug[r][col] / aug[col][col]
                for k in range(col, n + 1):
                    aug[r][k] -= f * aug[col][k]
    return [aug[i][n] / aug[i][i] for i in range(n)]
