"""The experiments at run time: the arms (each a ``Router`` built from the picker's config with the arm's
overlay), the assignment of each request, the per-request ``Trial`` that observes the response and becomes one
decision-log record, the per-arm counters and their metric families, and ``/admin/experiments``.
Built always and empty while ``experiments.enabled`` is false (no table, no thread, no series).
See docs/experiments.md.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from picker.config import ExperimentsConfig, Settings, arm_settings
from picker.experiments.assign import SOURCE_FIRST_TURN, SOURCE_HEADER, SOURCE_NONE, Assigner, SessionKey, SessionTurns
from picker.experiments.assign import session_of as _session_of
from picker.experiments.decision_log import DecisionLog
from picker.facts import RequestFacts
from picker.ops.metrics import PlainHistogram
from picker.ops.usage import RATIO_BUCKETS, Usage, keep_tail, ratio_bucket, usage_in
from picker.pool.preemptions import PreemptionWindows
from picker.routing.core import Router

log = logging.getLogger("kv_epp.experiments")
_RANK = re.compile(r"\.rank\d+$")  # a pod's N-th target port (``picker.shared.discovery.model.backend_name``)
_mono = time.monotonic
_wall = time.time

RESULTS = ("complete", "incomplete", "error", "unknown")
MAX_MODEL_CHARS = 256  # a client's model name, as recorded (a record's size stays bounded)
SSE_DONE = b"data: [DONE]"  # the OpenAI stream's terminal event
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class ArmCounts:
    """One arm's counts since the picker started (bounded: fixed fields)."""

    requests: int = 0
    sessions: int = 0  # sessions whose first request this picker saw in this arm
    buckets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RATIO_BUCKETS, 0))
    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    ttft: PlainHistogram = field(default_factory=lambda: PlainHistogram(TTFT_BUCKETS))


class Arm:
    """One arm: its name, weight, the config its requests route with, and its router."""

    def __init__(
        self,
        name: str,
        weight: float,
        settings: Settings,
        router: Router,
        tier4: bool,
        endpoints: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.weight = weight
        self.endpoints = endpoints  # the arm's own part of the pool (empty: all of it)
        self.settings = settings
        self.router = router
        self.tier4 = tier4  # Tier 4 consulted for this arm's requests
        self.affinity = settings.session_affinity.enabled

    def subset(self, hint: Sequence[str] | None, address_of: Callable[[str], str | None]) -> Sequence[str] | None:
        """The addresses this arm's request may go to: the proxy's subset hint (addresses; None: none) within the
        arm's own endpoints (``address_of``: an endpoint's address in the pool now, None when it is not in it)."""
        if not self.endpoints:
            return hint
        own = [a for n in self.endpoints if (a := address_of(n)) is not None]
        if hint is None:
            return own
        return [a for a in hint if a in own]


class Experiments:
    """See the module docstring. ``configure`` (at start and at every reload) rebuilds the arms; their counts
    are kept by arm name (a reload that keeps an arm keeps its counts; a removed arm's series go)."""

    def __init__(self, preemptions: PreemptionWindows, registry: CollectorRegistry | None = None) -> None:
        self.preemptions = preemptions
        self.cfg = ExperimentsConfig()
        self.enabled = False
        self.arms: dict[str, Arm] = {}
        self.counts: dict[str, ArmCounts] = {}
        self.assigner: Assigner | None = None
        self.turns = SessionTurns(1)
        self.header_names: tuple[str, ...] = ()
        self.sources: dict[str, int] = dict.fromkeys((SOURCE_HEADER, SOURCE_FIRST_TURN, SOURCE_NONE), 0)
        self.log: DecisionLog | None = None
        self._pool_names: tuple[str, ...] = ()
        self._salt = ""
        if registry is not None:
            registry.register(ExperimentsCollector(self))

    # -- configuration (never on the request path) ------------------------------------------------------
    def configure(self, settings: Settings, tier4_available: bool) -> None:
        cfg = settings.experiments
        self.cfg = cfg
        self.enabled = cfg.enabled
        if not cfg.enabled:
            self.arms, self.counts, self.assigner, self._salt = {}, {}, None, ""
            self.turns = SessionTurns(1)
            self._close_log()
            return
        old_weights = {n: a.weight for n, a in self.arms.items()}
        arms: dict[str, Arm] = {}
        for name, arm_cfg in cfg.arms.items():
            s = arm_settings(settings, name, arm_cfg)  # checked against these settings first (app: arm_problems)
            kept = self.arms.get(name)
            if kept is not None:  # the arm's router keeps its state (its strategy's, its ring)
                router = kept.router
                router.reconfigure(s)
            else:
                router = Router(s)
            router.set_pool_names(self._pool_names)
            tier4 = tier4_available and router.tier4_active()
            arms[name] = Arm(name, arm_cfg.weight, s, router, tier4, arm_cfg.endpoints)
        weights = {n: a.weight for n, a in arms.items()}
        if old_weights and (weights != old_weights or cfg.salt != self._salt):
            log.warning(
                "event=experiment_reassigned arms=%s salt_changed=%s (the arms, their weights or the salt changed: "
                "some sessions now land in another arm; analyse the logs before and after apart)",
                ",".join(sorted(weights)), cfg.salt != self._salt,
            )  # fmt: skip
        self._salt = cfg.salt
        self.arms = arms
        self.counts = {name: self.counts.get(name) or ArmCounts() for name in arms}
        self.assigner = Assigner(cfg.salt, {n: a.weight for n, a in arms.items()})
        names = (settings.session_affinity.header, *cfg.session_headers)
        self.header_names = tuple(dict.fromkeys(h.lower() for h in names))
        self.turns.max_sessions = cfg.max_sessions  # a smaller bound evicts at the next new session
        self._open_log(cfg)

    def _open_log(self, cfg: ExperimentsConfig) -> None:
        target = cfg.decision_log
        if target is None:
            self._close_log()
            return
        if self.log is not None and self.log.same(
            target, cfg.decision_log_max_bytes, cfg.decision_log_backups, cfg.decision_log_queue
        ):
            return
        old = self._close_log()  # not waited for here (the event loop): the new writer waits for it
        self.log = DecisionLog(
            target, cfg.decision_log_max_bytes, cfg.decision_log_backups, cfg.decision_log_queue, after=old
        )
        log.info("event=decision_log_opened target=%s", target)

    def _close_log(self) -> DecisionLog | None:
        """Stop taking records; the writer finishes its queue by itself (never joined on the event loop)."""
        old, self.log = self.log, None
        if old is not None:
            old.close(wait=False)
        return old

    def close(self) -> bool:
        """At stop (off the event loop): the decision log's queued records are written, within a bounded wait.
        True when they all were."""
        old, self.log = self.log, None
        return old.close() if old is not None else True

    def set_pool_names(self, names: tuple[str, ...]) -> None:
        """The pool's names: every arm's ring follows (called where the picker's own router's ring is rebuilt)."""
        self._pool_names = names
        for arm in self.arms.values():
            arm.router.set_pool_names(names)

    @property
    def wanted_headers(self) -> frozenset[str]:
        return frozenset(self.header_names) if self.enabled else frozenset()

    # -- the request path -----------------------------------------------------------------------------
    def start(self, headers: Mapping[str, str], facts: RequestFacts, arrived: float | None = None) -> Trial | None:
        """The request's arm and its trial (None while disabled). ``arrived``: when its headers reached the picker
        (monotonic), the start of its latencies; now when not given."""
        assigner = self.assigner
        if not self.enabled or assigner is None:
            return None
        key = _session_of(headers, facts, self.header_names)
        name = assigner.arm(key.digest)
        now = arrived if arrived is not None else _mono()
        # a request with nothing to key its session on is a session of its own: not tracked (it would only push
        # real sessions out of the table)
        turn, start_gap, idle_gap = (1, None, None) if key.source == SOURCE_NONE else self.turns.begin(key.digest, now)
        counts = self.counts[name]
        counts.requests += 1
        if turn == 1:
            counts.sessions += 1
        self.sources[key.source] += 1
        return Trial(self, self.arms[name], key, facts, headers.get("x-request-id"), now, turn, start_gap, idle_gap)

    def finish(
        self, trial: Trial, record: dict[str, Any], completed: bool, result: str, ttft: float | None, bucket: str
    ) -> None:
        counts = self.counts.get(trial.arm.name)
        if counts is not None:  # None: a reload removed the arm while the request ran
            counts.results[result] += 1
            counts.buckets[bucket] += 1
            if ttft is not None and result != "error":  # an error's latency is not a first token's
                counts.ttft.observe(ttft)
        if trial.session.source != SOURCE_NONE:
            self.turns.end(trial.session.digest, trial.ended_at, completed and result != "error")
        dl = self.log  # read once: a stop may clear it from another thread
        if dl is not None:
            dl.write(record)

    def stats(self) -> dict[str, Any]:
        """``GET /admin/experiments``."""
        total = sum(a.weight for a in self.arms.values()) or 1.0
        return {
            "enabled": self.enabled,
            "salt": self.cfg.salt if self.enabled else None,
            "session_headers": list(self.header_names),
            "assignment_sources": dict(self.sources),
            "sessions_tracked": len(self.turns) if self.enabled else 0,
            "max_sessions": self.cfg.max_sessions,
            "arms": {
                name: {
                    "weight": arm.weight,
                    "share": arm.weight / total,
                    "overlay": self.cfg.arms[name].overlay if name in self.cfg.arms else {},
                    "strategy": arm.settings.selection_strategy,
                    "endpoints": list(arm.endpoints),
                    "tier4": arm.tier4,
                    "scoring_mode": arm.settings.kv_cache_index.scoring.mode,
                    "requests": self.counts[name].requests,
                    "sessions": self.counts[name].sessions,
                    "cached_ratio": dict(self.counts[name].buckets),
                    "responses": dict(self.counts[name].results),
                }
                for name, arm in self.arms.items()
            },
            "decision_log": self.log.stats() if self.log is not None else None,
        }


class Trial:
    """One request of an experiment, from its assignment to the end of its response: a response observer of its
    exchange (the body only when it reaches the picker), then one decision-log record."""

    __slots__ = (
        "arm",
        "body_seen",
        "ended_at",
        "exps",
        "facts",
        "finished",
        "first_body_at",
        "first_byte_at",
        "idle_gap",
        "readable",
        "request_id",
        "session",
        "start_gap",
        "started_at",
        "started_wall",
        "status",
        "tail",
        "turn",
    )  # fmt: skip

    wants_body = True

    def __init__(
        self,
        exps: Experiments,
        arm: Arm,
        session: SessionKey,
        facts: RequestFacts,
        request_id: str | None,
        now: float,
        turn: int,
        start_gap: float | None,
        idle_gap: float | None,
    ) -> None:
        self.exps = exps
        self.arm = arm
        self.session = session
        self.facts = facts
        self.request_id = request_id[:128] if request_id else None
        self.started_at = now
        self.started_wall = _wall() - (_mono() - now)
        self.finished = False
        self.turn = turn
        self.start_gap = start_gap
        self.idle_gap = idle_gap
        self.readable = False
        self.body_seen = False
        self.first_byte_at: float | None = None
        self.first_body_at: float | None = None
        self.ended_at = now
        self.status: int | None = None
        self.tail = b""

    # -- the picker answered the request itself (429, 503), or it ended unrouted (None) ----------------
    def answered(self, status: int | None) -> None:
        self.status = status
        self._finish(None, completed=False)

    # -- the response (ResponseObserver) ----------------------------------------------------------------
    def on_headers(self, ex: Any, status: int | None) -> None:
        self.status = status
        self.first_byte_at = _mono()

    def on_body(self, ex: Any, chunk: bytes, end: bool) -> None:
        self.body_seen = True
        if chunk:
            if self.first_body_at is None:
                self.first_body_at = _mono()
            self.tail = keep_tail(self.tail, chunk)

    def on_end(self, ex: Any, completed: bool) -> None:
        self._finish(ex, completed)

    def _finish(self, ex: Any, completed: bool) -> None:
        if self.finished:  # once: a request dispatched just as its client left ends its exchange, then raises
            return
        self.finished = True
        now = self.ended_at = _mono()
        t0 = self.started_at
        decision = ex.decision if ex is not None else None
        endpoint = decision.endpoint.name if decision is not None else None
        seen = self.readable or self.body_seen
        usage: Usage | None = usage_in(self.tail) if self.tail else None
        kv = ex.kv if ex is not None else None
        status = self.status
        error = status is None or status >= 400
        # complete: the response's body ended normally; known only where the body reaches the picker (the
        # picker's own answers are never complete)
        # (an SSE stream is complete once its terminal event passed: a client may close the connection at
        # ``data: [DONE]``, before the body's end reaches the picker)
        done = completed or self.tail.rstrip().endswith(SSE_DONE)
        complete: bool | None = False if ex is None else done if seen else None
        result = "error" if error else "unknown" if complete is None else "complete" if complete else "incomplete"
        prompt = usage.prompt_tokens if usage is not None else None
        cached = usage.cached_tokens if usage is not None else None
        ttft = self.first_body_at - t0 if self.first_body_at is not None else None
        window = None
        if endpoint is not None:
            w = self.exps.cfg.preemption_window_seconds
            window = self.exps.preemptions.exposure(endpoint, min(t0, now - w), now)
        pod, namespace = _pod_of(endpoint, self.arm.settings)
        record: dict[str, Any] = {
            "v": 1,
            "ts": round(self.started_wall, 6),
            "request_id": self.request_id,
            "session": self.session.id,
            "session_source": self.session.source,
            "arm": self.arm.name,
            "turn": self.turn,
            "start_gap_s": _r(self.start_gap),
            "idle_gap_s": _r(self.idle_gap),
            "model": self.facts.model[:MAX_MODEL_CHARS] if self.facts.model is not None else None,
            "stream": self.facts.stream,
            "endpoint": endpoint,
            "pod": pod,
            "namespace": namespace,
            "strategy": decision.strategy if decision is not None else None,
            "reason": decision.reason if decision is not None else None,
            "prompt_tokens_predicted": kv.prompt_tokens if kv is not None else None,
            "cached_tokens_predicted": kv.predicted_cached if kv is not None else None,
            "status": status,
            "first_byte_s": _r(self.first_byte_at - t0 if self.first_byte_at is not None else None),
            "ttft_s": _r(ttft),
            "duration_s": _r(now - t0),
            "complete": complete,
            "usage": {
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": usage.completion_tokens if usage is not None else None,
            },
            "preempt_window": window,
        }
        self.exps.finish(self, record, done if seen else completed, result, ttft, ratio_bucket(prompt, cached))


def _r(v: float | None) -> float | None:
    return round(v, 6) if v is not None else None


def _pod_of(endpoint: str | None, settings: Settings) -> tuple[str | None, str | None]:
    """The pod and namespace of a discovered endpoint (its name is the pod's, ``.rankN`` for a pod's N-th port);
    None for a static pool's."""
    ref = settings.pool.inference_pool
    if endpoint is None or ref is None:
        return None, None
    return _RANK.sub("", endpoint), ref.namespace


class ExperimentsCollector(Collector):
    """The per-arm families, built at scrape time; none while disabled. Cardinality: arms (at most 8) × the
    fixed buckets and results."""

    def __init__(self, exps: Experiments) -> None:
        self.e = exps

    def collect(self) -> Iterator[Metric]:
        e = self.e
        if not e.enabled:
            return
        requests = CounterMetricFamily(
            "kv_epp_experiment_requests", "Requests assigned to each experiment arm", labels=["arm"]
        )
        sessions = CounterMetricFamily(
            "kv_epp_experiment_sessions",
            "Sessions whose first request this picker assigned to each arm",
            labels=["arm"],
        )
        ratio = CounterMetricFamily(
            "kv_epp_experiment_cached_ratio_requests",
            "Finished requests per arm by the engine-observed cached ratio (usage cached_tokens / prompt_tokens) in "
            "the buckets 0, (0,0.5], (0.5,0.9], (0.9,1], and unknown (no usage seen: the sample size is the rest)",
            labels=["arm", "bucket"],
        )
        results = CounterMetricFamily(
            "kv_epp_experiment_responses",
            "Finished requests per arm: complete, incomplete (a 2xx/3xx whose body did not end), error (status "
            ">= 400 or none), unknown (the body does not reach the picker)",
            labels=["arm", "result"],
        )
        for name, c in list(e.counts.items()):
            requests.add_metric([name], c.requests)
            sessions.add_metric([name], c.sessions)
            for b, n in c.buckets.items():
                ratio.add_metric([name, b], n)
            for r, n in c.results.items():
                results.add_metric([name, r], n)
        yield requests
        yield sessions
        yield ratio
        yield results
        ttft = HistogramMetricFamily(
            "kv_epp_experiment_ttft_seconds",
            "Time from the request's arrival at the picker to the first byte of the response body, per arm (only "
            "where the response body reaches the picker)",
            labels=["arm"],
        )
        for name, c in list(e.counts.items()):
            ttft.add_metric([name], c.ttft.cumulative(), c.ttft.sum)
        yield ttft
        dl = e.log
        if dl is not None:
            records = CounterMetricFamily(
                "kv_epp_experiment_decision_log_records",
                "Decision-log records written, and dropped (the queue was full, or a write failed)",
                labels=["result"],
            )
            records.add_metric(["written"], dl.written)
            records.add_metric(["dropped"], dl.dropped + dl.lost)
            yield records
