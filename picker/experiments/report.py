"""The experiment report (``kv-epp experiment report``): reads the picker's decision logs (JSON lines, contract
version 1), computes each arm's metrics, each arm's difference from the baseline arm with a session-clustered
bootstrap interval, and the platform spec's non-inferiority verdict per metric, plus the exploration tables.
Pure Python (``random``, ``statistics``, ``math``), no network; matplotlib only for ``--plot``, imported there.
See docs/experiments.md, "The report: kv-epp experiment report".

The ``--json`` object's keys:

- ``v``: 1, this object's version.
- ``inputs``: ``files``; ``records`` (the valid ones); ``malformed`` (lines skipped); ``problems`` (the first
  20 ``file:line: message`` strings); ``problems_omitted`` (the malformed lines past those 20).
- ``settings``: ``baseline``, ``arms`` (sorted by name), ``metrics`` (the compared ones), ``confidence``,
  ``bootstrap``, ``seed``, ``margin`` (the default), ``margins`` (each compared metric's margin as given).
- ``arms``: per arm, ``requests``, ``sessions``, ``hit_ratio``, ``cached_ratio_mean``, ``cached_tokens``,
  ``prompt_tokens``, ``ttft_p50``, ``ttft_p99``, ``first_byte_p50``, ``first_byte_p99`` (seconds),
  ``error_rate``, ``incomplete_rate``, ``preempt_rate`` and ``missing`` (``usage``, ``ttft``, ``first_byte``,
  ``complete``, ``preempt_window``: the shares of the arm's requests with that value unknown). null: no data.
- ``contamination``: ``sessions`` (how many appear in more than one arm), ``valid`` (that count is 0),
  ``examples`` (up to 20 of them).
- ``comparisons``: one object per (arm, metric), every arm but the baseline: ``arm``, ``baseline``, ``metric``,
  ``better`` (``higher``/``lower``), ``baseline_value``, ``value``, ``diff`` (value - baseline_value), ``ci``
  ([lo, hi] of the diff), ``improvement`` and ``improvement_ci`` (oriented: better is positive), ``margin``
  (as given), ``margin_kind`` (``absolute``/``relative``), ``margin_abs`` (in the metric's unit), ``differs``
  (the diff's interval excludes 0), ``verdict`` (``non_inferior``/``inconclusive``/``regression``/
  ``insufficient_data``), ``resamples_used`` (the resamples in which both arms had data for the metric).
- ``tables``: ``cached_ratio`` and ``preempt_window``, lists of rows: ``arm``, ``bucket``, ``requests``,
  ``share`` (of the arm's requests), ``sessions``, ``ttft_p50``, ``incomplete_rate``, ``error_rate``,
  ``missing_rate`` (TTFT unknown).
- ``rule``: the verdict rule and each metric's margin, in one sentence.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import itemgetter, mod, mul
from pathlib import Path
from typing import Any, Literal, NoReturn

from picker.ops.usage import RATIO_BUCKETS, ratio_bucket

LOG_VERSION = 1
MAX_PROBLEMS = 20  # malformed lines kept with their message; the rest are only counted
MAX_EXAMPLES = 20  # contaminated sessions listed by id
DEFAULT_MARGIN = 0.02
DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
CACHED_BUCKETS = RATIO_BUCKETS
PREEMPT_BUCKETS = ("0", "1", "unknown")
VERDICTS = ("non_inferior", "inconclusive", "regression", "insufficient_data")
VERDICT_COLORS = {
    "non_inferior": "tab:green",
    "inconclusive": "tab:gray",
    "regression": "tab:red",
    "insufficient_data": "tab:gray",
}


class ReportError(ValueError):
    """A problem with the report's input or options (a missing file, an unknown metric): the CLI's exit 2."""


@dataclass(frozen=True, slots=True)
class Metric:
    """A compared metric: which way is better, and whether its margin is absolute or relative to the baseline."""

    name: str
    higher_is_better: bool
    margin_kind: Literal["absolute", "relative"]
    definition: str


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("hit_ratio", True, "absolute", "sum(cached_tokens) / sum(prompt_tokens), both known"),
        Metric("cached_ratio_mean", True, "absolute", "mean of cached/prompt per request, prompt > 0"),
        Metric("ttft_p50", False, "relative", "median of ttft_s, known, of responses without error"),
        Metric("ttft_p99", False, "relative", "99th percentile of ttft_s, known, without error"),
        Metric("first_byte_p50", False, "relative", "median of first_byte_s, known, without error"),
        Metric("first_byte_p99", False, "relative", "99th percentile of first_byte_s, known, without error"),
        Metric("error_rate", False, "absolute", "share of requests with status null or >= 400"),
        Metric("incomplete_rate", False, "absolute", "complete false among status < 400 with complete known"),
    )
}


# -- the log --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Record:
    """What the report reads of one decision-log line (None: unknown)."""

    session: str
    arm: str
    status: int | None = None
    ttft_s: float | None = None
    first_byte_s: float | None = None
    complete: bool | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    preempt_window: int | None = None

    @property
    def error(self) -> bool:
        return self.status is None or self.status >= 400

    @property
    def usage_known(self) -> bool:
        return self.prompt_tokens is not None and self.cached_tokens is not None

    @property
    def cached_bucket(self) -> str:
        """The cached-ratio bucket: ``0`` (cached == 0), ``(0,0.5]``, ``(0.5,0.9]``, ``(0.9,1]``, or ``unknown``
        (a usage value unknown, or an empty prompt: no ratio; as the picker's own bucket label)."""
        return ratio_bucket(self.prompt_tokens, self.cached_tokens)

    @property
    def preempt_bucket(self) -> str:
        return "unknown" if self.preempt_window is None else str(self.preempt_window)


@dataclass(slots=True)
class Problems:
    """The malformed lines: all counted, the first ``MAX_PROBLEMS`` kept as ``file:line: message``."""

    count: int = 0
    messages: list[str] = field(default_factory=list)

    def add(self, where: str, message: str) -> None:
        self.count += 1
        if len(self.messages) < MAX_PROBLEMS:
            self.messages.append(f"{where}: {message}")

    @property
    def omitted(self) -> int:
        return self.count - len(self.messages)


class _Malformed(ValueError):
    pass


def _reject_constant(name: str) -> NoReturn:
    raise _Malformed(f"{name} is not a number")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check(obj: dict[str, Any], key: str, ok: Callable[[object], bool], what: str) -> Any:
    """``obj[key]``, None when absent or null; a value that ``ok`` refuses is malformed."""
    value = obj.get(key)
    if value is not None and not ok(value):
        raise _Malformed(f"{key}: expected {what}, got {json.dumps(value)[:40]}")
    return value


def _str(v: object) -> bool:
    return isinstance(v, str)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _seconds(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v >= 0


# The contract's other fields, type-checked though the report does not read them (null or absent: unknown).
_OTHER_FIELDS: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("ts", _is_number, "a number"),
    ("turn", _is_int, "an integer"),
    ("start_gap_s", _is_number, "a number"),
    ("idle_gap_s", _is_number, "a number"),
    ("prompt_tokens_predicted", _is_int, "an integer"),
    ("cached_tokens_predicted", _is_int, "an integer"),
    ("duration_s", _is_number, "a number"),
    *(
        (k, _str, "a string")
        for k in ("request_id", "session_source", "model", "endpoint", "pod", "namespace", "strategy", "reason")
    ),
)


def parse_record(obj: object) -> Record:
    """One decoded log line as a ``Record``; raises ``ValueError`` (with what is wrong) when it is malformed."""
    if not isinstance(obj, dict):
        raise _Malformed(f"expected an object, got {type(obj).__name__}")
    v = obj.get("v")
    if not _is_int(v) or v != LOG_VERSION:
        raise _Malformed(f"v: expected {LOG_VERSION}, got {json.dumps(v)[:40]}")
    for key in ("session", "arm"):
        if not isinstance(obj.get(key), str):
            raise _Malformed(f"{key}: expected a string, got {json.dumps(obj.get(key))[:40]}")
    for key, ok, what in _OTHER_FIELDS:
        _check(obj, key, ok, what)
    usage = _check(obj, "usage", lambda u: isinstance(u, dict), "an object") or {}
    prompt = _check(usage, "prompt_tokens", _count, "a count")
    cached = _check(usage, "cached_tokens", _count, "a count")
    _check(usage, "completion_tokens", _count, "a count")
    if prompt is not None and cached is not None and cached > prompt:
        raise _Malformed(f"usage: cached_tokens {cached} > prompt_tokens {prompt}")
    return Record(
        session=obj["session"],
        arm=obj["arm"],
        status=_check(obj, "status", _is_int, "an integer"),
        ttft_s=_check(obj, "ttft_s", _seconds, "seconds >= 0"),
        first_byte_s=_check(obj, "first_byte_s", _seconds, "seconds >= 0"),
        complete=_check(obj, "complete", lambda c: isinstance(c, bool), "true or false"),
        prompt_tokens=prompt,
        cached_tokens=cached,
        preempt_window=_check(obj, "preempt_window", lambda p: _is_int(p) and p in (0, 1), "0 or 1"),
    )


def load_records(paths: Iterable[str | Path]) -> tuple[list[Record], Problems]:
    """Every valid record of the files, in order, and the malformed lines (not JSON, not an object, ``v`` not 1,
    ``session``/``arm`` missing, a wrong type): counted and skipped. Blank lines are skipped silently. A file
    that cannot be read raises ``ReportError``."""
    records: list[Record] = []
    problems = Problems()
    for path in paths:
        try:
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        records.append(parse_record(json.loads(raw, parse_constant=_reject_constant)))
                    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, _Malformed
                        problems.add(f"{path}:{lineno}", str(exc).splitlines()[0] if str(exc) else "malformed")
        except FileNotFoundError:
            raise ReportError(f"{path}: no such file") from None
        except OSError as exc:
            raise ReportError(f"{path}: {exc.strerror or exc}") from None
    return records, problems


# -- one arm, pre-aggregated per session ------------------------------------------------------------------------
QUANTILE_BLOCK = 256  # a latency's sorted values are summed per block of this many, then searched in one block


@dataclass(slots=True)
class _Sorted:
    """One latency's known values, sorted, each with the index of the session it came from (``owner``), and per
    block of ``QUANTILE_BLOCK`` values a getter of their owners' weights (one C call per block)."""

    values: list[float]
    owner: list[int]
    blocks: list[Callable[[Sequence[int]], tuple[int, ...]]]

    @classmethod
    def of(cls, pairs: list[tuple[float, int]]) -> _Sorted:
        pairs.sort()
        owner = [i for _, i in pairs]
        blocks = [_getter(owner[b : b + QUANTILE_BLOCK]) for b in range(0, len(owner), QUANTILE_BLOCK)]
        return cls([v for v, _ in pairs], owner, blocks)


def _getter(indices: list[int]) -> Callable[[Sequence[int]], tuple[int, ...]]:
    if len(indices) == 1:  # itemgetter of one index returns the item itself, not a tuple
        only = indices[0]
        return lambda w: (w[only],)
    return itemgetter(*indices)


# An arm's per-session sums, in this order; ``ratio_fixed`` is the sum of cached/prompt in units of 2**-32.
SUMS = ("requests", "errors", "cached", "prompt", "ratio_n", "ratio_fixed", "ok_known", "incomplete")
RATIO_BITS = 32


@dataclass(slots=True)
class _Arm:
    """One arm, pre-aggregated per session (index i: the arm's i-th session by id) for the bootstrap, whose
    resample is a weight per session (how often it was drawn). The ``SUMS`` of a session are packed into one
    integer (``packed``), each in a bit field (``shifts``, ``widths``) wide enough for any resample's total, so a
    resample's totals are one dot product of the weights and ``packed``, run in C."""

    name: str
    sessions: list[str]
    packed: list[int]
    shifts: list[int]
    widths: list[int]
    ttft: _Sorted
    first_byte: _Sorted

    def totals(self, w: Sequence[int]) -> dict[str, int]:
        total = sum(map(mul, w, self.packed))
        return {k: (total >> s) & ((1 << n) - 1) for k, s, n in zip(SUMS, self.shifts, self.widths, strict=True)}


def _arm(name: str, records: Sequence[Record]) -> _Arm:
    sessions = sorted({r.session for r in records})
    index = {s: i for i, s in enumerate(sessions)}
    n = len(sessions)
    sums = {k: [0] * n for k in SUMS}
    ttft: list[tuple[float, int]] = []
    first_byte: list[tuple[float, int]] = []
    for r in records:
        i = index[r.session]
        sums["requests"][i] += 1
        sums["errors"][i] += r.error
        if r.prompt_tokens is not None and r.cached_tokens is not None:
            sums["cached"][i] += r.cached_tokens
            sums["prompt"][i] += r.prompt_tokens
            if r.prompt_tokens > 0:
                sums["ratio_n"][i] += 1
                sums["ratio_fixed"][i] += (r.cached_tokens << RATIO_BITS) // r.prompt_tokens
        if not r.error and r.complete is not None:
            sums["ok_known"][i] += 1
            sums["incomplete"][i] += not r.complete
        if r.ttft_s is not None and not r.error:  # an error's latency is not a first token's (a fast 500)
            ttft.append((r.ttft_s, i))
        if r.first_byte_s is not None and not r.error:
            first_byte.append((r.first_byte_s, i))
    # A resample draws n sessions, so no field's total exceeds n times its largest session's value.
    widths = [(n * max(sums[k])).bit_length() + 1 for k in SUMS]
    shifts = list(accumulate(widths[:-1], initial=0))
    packed = [sum(v << sh for v, sh in zip(values, shifts, strict=True)) for values in zip(*sums.values(), strict=True)]
    return _Arm(name, sessions, packed, shifts, widths, _Sorted.of(ttft), _Sorted.of(first_byte))


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` by linear interpolation between the closest ranks (numpy's
    default, ``statistics.quantiles(method="inclusive")``); None for no values."""
    if not values:
        return None
    pos = q * (len(values) - 1)
    k = math.floor(pos)
    frac = pos - k
    if frac == 0:
        return values[k]
    return values[k] + frac * (values[k + 1] - values[k])


def _weighted_quantiles(s: _Sorted, weights: Sequence[int], qs: Sequence[float]) -> list[float | None]:
    """The ``qs`` quantiles of the multiset in which each value appears as often as its session was drawn, by
    ``_quantile``'s rule: the weights summed per block, then the order statistics found within their blocks."""
    if not s.values:
        return [None] * len(qs)
    cum_blocks = list(accumulate(sum(block(weights)) for block in s.blocks))
    total = cum_blocks[-1]
    if total == 0:
        return [None] * len(qs)

    def nth(k: int) -> float:  # the k-th (0-based) value of the weighted multiset
        b = bisect_right(cum_blocks, k)
        before = cum_blocks[b - 1] if b else 0
        return s.values[b * QUANTILE_BLOCK + bisect_right(list(accumulate(s.blocks[b](weights))), k - before)]

    out: list[float | None] = []
    for q in qs:
        pos = q * (total - 1)
        k = math.floor(pos)
        lo = nth(k)
        out.append(lo if pos == k else lo + (pos - k) * (nth(k + 1) - lo))
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _evaluate(a: _Arm, w: Sequence[int], names: Collection[str]) -> dict[str, float | None]:
    """The metrics ``names`` of arm ``a`` with session weights ``w`` (all ones: the arm as observed);
    ``cached_ratio_mean`` to within 2**-32 (its per-request ratios are fixed-point)."""
    t = a.totals(w)
    out: dict[str, float | None] = {}
    if "hit_ratio" in names:
        out["hit_ratio"] = _ratio(t["cached"], t["prompt"])
    if "cached_ratio_mean" in names:
        out["cached_ratio_mean"] = _ratio(t["ratio_fixed"] / (1 << RATIO_BITS), t["ratio_n"])
    if "error_rate" in names:
        out["error_rate"] = _ratio(t["errors"], t["requests"])
    if "incomplete_rate" in names:
        out["incomplete_rate"] = _ratio(t["incomplete"], t["ok_known"])
    for prefix, values in (("ttft", a.ttft), ("first_byte", a.first_byte)):
        wanted = [q for q in (50, 99) if f"{prefix}_p{q}" in names]
        if wanted:
            for q, v in zip(wanted, _weighted_quantiles(values, w, [q / 100 for q in wanted]), strict=True):
                out[f"{prefix}_p{q}"] = v
    return out


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _summary(a: _Arm, records: Sequence[Record]) -> dict[str, Any]:
    n = len(records)
    totals = a.totals([1] * len(a.sessions))
    preempt_known = [r.preempt_window for r in records if r.preempt_window is not None]
    return {
        "requests": n,
        "sessions": len(a.sessions),
        **_evaluate(a, [1] * len(a.sessions), METRICS),
        "cached_tokens": totals["cached"],
        "prompt_tokens": totals["prompt"],
        "preempt_rate": _share(sum(preempt_known), len(preempt_known)),
        "missing": {
            "usage": _share(sum(not r.usage_known for r in records), n),
            "ttft": _share(sum(r.ttft_s is None for r in records), n),
            "first_byte": _share(sum(r.first_byte_s is None for r in records), n),
            "complete": _share(sum(r.complete is None for r in records), n),
            "preempt_window": _share(n - len(preempt_known), n),
        },
    }


# -- the bootstrap and the verdict ------------------------------------------------------------------------------
def _draw(rng: random.Random, n: int) -> list[int]:
    """How often each of ``n`` sessions is drawn in one resample of ``n`` with replacement: 32-bit random words
    modulo ``n``, the words at or above the largest multiple of ``n`` (rare: under n/2**32 of them) rejected, so
    every session is exactly equally likely."""
    w = [0] * n
    limit = (1 << 32) - (1 << 32) % n
    need = n
    while need:
        words: Sequence[int] = memoryview(rng.randbytes(4 * need)).cast("I")  # "I": 4 bytes on every target
        if max(words) >= limit:
            words = [x for x in words if x < limit]
        for i in map(mod, words, repeat(n)):
            w[i] += 1
        need -= len(words)
    return w


def _bootstrap_diffs(
    arms: Sequence[_Arm], baseline: str, names: Collection[str], resamples: int, seed: int
) -> dict[str, dict[str, list[float]]]:
    """Per non-baseline arm and metric, the resampled ``arm - baseline`` differences: each resample draws every
    arm's sessions with replacement, separately (the arms are independent groups), and recomputes the metrics on
    the drawn sessions' requests. A resample in which either arm has no data for a metric is left out."""
    rng = random.Random(seed)
    diffs: dict[str, dict[str, list[float]]] = {a.name: {m: [] for m in names} for a in arms if a.name != baseline}
    for _ in range(resamples):
        values = {a.name: _evaluate(a, _draw(rng, len(a.sessions)), names) for a in arms}
        base = values[baseline]
        for arm, per_metric in diffs.items():
            for m, out in per_metric.items():
                x, b = values[arm][m], base[m]
                if x is not None and b is not None:
                    out.append(x - b)
    return diffs


def verdict(lo: float, hi: float, margin: float) -> str:
    """The spec's non-inferiority rule on the improvement interval [lo, hi] (better is positive) and the margin:
    ``non_inferior`` if lo > -margin, ``regression`` if hi < -margin, otherwise ``inconclusive``."""
    if lo > -margin:
        return "non_inferior"
    if hi < -margin:
        return "regression"
    return "inconclusive"


def _compare(
    arm: str,
    baseline: str,
    metric: Metric,
    summaries: dict[str, dict[str, Any]],
    diffs: list[float],
    margin: float,
    confidence: float,
    resamples: int,
) -> dict[str, Any]:
    """One comparison row (its keys: the module docstring): the diff's percentile interval over the resampled
    ``diffs``, oriented, against the margin (relative ones times the baseline's value). ``insufficient_data`` when
    an arm has no value, or fewer than half the resamples had data in both arms."""
    base, value = summaries[baseline][metric.name], summaries[arm][metric.name]
    sign = 1.0 if metric.higher_is_better else -1.0
    row: dict[str, Any] = {
        "arm": arm,
        "baseline": baseline,
        "metric": metric.name,
        "better": "higher" if metric.higher_is_better else "lower",
        "baseline_value": base,
        "value": value,
        "diff": None,
        "ci": None,
        "improvement": None,
        "improvement_ci": None,
        "margin": margin,
        "margin_kind": metric.margin_kind,
        "margin_abs": None,
        "differs": None,
        "verdict": "insufficient_data",
        "resamples_used": len(diffs),
    }
    if base is None or value is None or 2 * len(diffs) < resamples:
        return row
    diffs.sort()
    lo, hi = _quantile(diffs, (1 - confidence) / 2), _quantile(diffs, (1 + confidence) / 2)
    assert lo is not None and hi is not None
    imp_lo, imp_hi = (lo, hi) if sign > 0 else (-hi, -lo)
    margin_abs = margin * abs(base) if metric.margin_kind == "relative" else margin
    row.update(
        diff=value - base,
        ci=[lo, hi],
        improvement=sign * (value - base),
        improvement_ci=[imp_lo, imp_hi],
        margin_abs=margin_abs,
        differs=lo > 0 or hi < 0,
        verdict=verdict(imp_lo, imp_hi, margin_abs),
    )
    return row


# -- the tables -------------------------------------------------------------------------------------------------
def _table(
    by_arm: dict[str, list[Record]], key: Callable[[Record], str], buckets: Sequence[str]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for arm, records in by_arm.items():
        groups: dict[str, list[Record]] = defaultdict(list)
        for r in records:
            groups[key(r)].append(r)
        for bucket in buckets:
            group = groups.get(bucket, [])
            n = len(group)
            ok_known = [r for r in group if not r.error and r.complete is not None]
            rows.append(
                {
                    "arm": arm,
                    "bucket": bucket,
                    "requests": n,
                    "share": _share(n, len(records)),
                    "sessions": len({r.session for r in group}),
                    "ttft_p50": _quantile(sorted(r.ttft_s for r in group if r.ttft_s is not None and not r.error), 0.5),
                    "incomplete_rate": _share(sum(r.complete is False for r in ok_known), len(ok_known)),
                    "error_rate": _share(sum(r.error for r in group), n),
                    "missing_rate": _share(sum(r.ttft_s is None for r in group), n),
                }
            )
    return rows


# -- the report -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReportOptions:
    """What the report compares and how (the CLI's flags; see ``add_arguments``)."""

    baseline: str | None = None  # None: the first arm by name
    metrics: tuple[str, ...] = tuple(METRICS)
    margin: float = DEFAULT_MARGIN
    margins: dict[str, float] = field(default_factory=dict)  # per-metric overrides
    confidence: float = DEFAULT_CONFIDENCE
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0


def rule_sentence(options: ReportOptions) -> str:
    """The verdict rule and each compared metric's margin, in one sentence."""
    margins = []
    for name in options.metrics:
        m = options.margins.get(name, options.margin)
        kind = METRICS[name].margin_kind
        margins.append(f"{name} {m:g}" if kind == "absolute" else f"{name} {m * 100:g}% of the baseline's value")
    return (
        "Rule: each metric is oriented so that better is positive; with the improvement's "
        f"{options.confidence * 100:g}% session-clustered bootstrap interval [lo, hi] and the margin m, the verdict "
        "is non_inferior if lo > -m, regression if hi < -m, otherwise inconclusive (no significant difference is not "
        "evidence of no harm); "
        f"margins: {', '.join(margins)}."
    )


def build_report(
    records: Sequence[Record], problems: Problems, options: ReportOptions, files: Sequence[str] = ()
) -> dict[str, Any]:
    """The report as one JSON-ready object (its keys: the module docstring). Raises ``ReportError`` when there
    are no records, or the baseline is not an arm."""
    if not records:
        raise ReportError(f"no valid records ({problems.count} malformed lines)")
    by_arm: dict[str, list[Record]] = defaultdict(list)
    arms_of: dict[str, set[str]] = defaultdict(set)
    for r in records:
        by_arm[r.arm].append(r)
        arms_of[r.session].add(r.arm)
    names = sorted(by_arm)
    by_arm = {name: by_arm[name] for name in names}
    baseline = options.baseline if options.baseline is not None else names[0]
    if baseline not in by_arm:
        raise ReportError(f"--baseline {baseline}: no such arm in the logs (arms: {', '.join(names)})")
    arms = [_arm(name, by_arm[name]) for name in names]
    summaries = {a.name: _summary(a, by_arm[a.name]) for a in arms}
    diffs = _bootstrap_diffs(arms, baseline, options.metrics, options.resamples, options.seed)
    comparisons = [
        _compare(
            arm,
            baseline,
            METRICS[m],
            summaries,
            diffs[arm][m],
            options.margins.get(m, options.margin),
            options.confidence,
            options.resamples,
        )
        for arm in names
        if arm != baseline
        for m in options.metrics
    ]
    mixed = sorted(s for s, a in arms_of.items() if len(a) > 1)
    return {
        "v": 1,
        "inputs": {
            "files": list(files),
            "records": len(records),
            "malformed": problems.count,
            "problems": list(problems.messages),
            "problems_omitted": problems.omitted,
        },
        "settings": {
            "baseline": baseline,
            "arms": names,
            "metrics": list(options.metrics),
            "confidence": options.confidence,
            "bootstrap": options.resamples,
            "seed": options.seed,
            "margin": options.margin,
            "margins": {m: options.margins.get(m, options.margin) for m in options.metrics},
        },
        "arms": summaries,
        "contamination": {"sessions": len(mixed), "valid": not mixed, "examples": mixed[:MAX_EXAMPLES]},
        "comparisons": comparisons,
        "tables": {
            "cached_ratio": _table(by_arm, lambda r: r.cached_bucket, CACHED_BUCKETS),
            "preempt_window": _table(by_arm, lambda r: r.preempt_bucket, PREEMPT_BUCKETS),
        },
        "rule": rule_sentence(options),
    }


# -- text -------------------------------------------------------------------------------------------------------
def _fmt(value: Any, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


TEXT_COLUMNS = frozenset({"arm", "metric", "better", "bucket", "verdict"})  # left-aligned; numbers right-aligned


def _aligned(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A table, two spaces between columns: ``TEXT_COLUMNS`` left-aligned, the others right-aligned."""
    table = [list(headers), *map(list, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    left = [h in TEXT_COLUMNS for h in headers]
    return [
        "  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(row, widths, left, strict=True)).rstrip()
        for row in table
    ]


ARM_COLUMNS = (
    "requests",
    "sessions",
    "hit_ratio",
    "cached_ratio_mean",
    "ttft_p50",
    "ttft_p99",
    "first_byte_p50",
    "first_byte_p99",
    "error_rate",
    "incomplete_rate",
    "preempt_rate",
)
TABLE_COLUMNS = ("requests", "share", "sessions", "ttft_p50", "incomplete_rate", "error_rate", "missing_rate")


def render_text(report: dict[str, Any]) -> str:
    """The report for a human: aligned tables, the verdict lines, the missing-data rates, the contamination and
    the rule (latencies in seconds)."""
    inputs, settings, arms = report["inputs"], report["settings"], report["arms"]
    out = [
        f"kv-epp experiment report: {len(inputs['files'])} file(s), {inputs['records']:,} records, "
        f"{inputs['malformed']:,} malformed line(s) skipped; baseline arm {settings['baseline']}",
        *(f"  malformed: {p}" for p in inputs["problems"]),
    ]
    if inputs["problems_omitted"]:
        out.append(f"  ... and {inputs['problems_omitted']:,} more malformed line(s)")
    c = report["contamination"]
    if c["valid"]:
        out.append("contamination: 0 sessions in more than one arm (it must be 0 for a valid experiment)")
    else:
        out.append(
            f"contamination: {c['sessions']:,} session(s) in more than one arm: NOT a valid experiment (each "
            f"session must stay in one arm); e.g. {', '.join(c['examples'][:5])}"
        )
    out += ["", "Arms (latencies in seconds)"]
    out += _aligned(("arm", *ARM_COLUMNS), ([a, *(_fmt(s[k]) for k in ARM_COLUMNS)] for a, s in arms.items()))
    missing_keys = ("usage", "ttft", "first_byte", "complete", "preempt_window")
    out += ["", "Missing data (share of the arm's requests with the value unknown)"]
    out += _aligned(
        ("arm", *missing_keys), ([a, *(_fmt(s["missing"][k]) for k in missing_keys)] for a, s in arms.items())
    )
    out += [
        "",
        f"Comparisons (arm - baseline; {settings['confidence'] * 100:g}% session-clustered bootstrap interval, "
        f"{settings['bootstrap']:,} resamples, seed {settings['seed']}; margin in the metric's unit)",
    ]
    rows = report["comparisons"]
    if not rows:
        out.append("  no arm to compare: the logs hold one arm")
    else:
        out += _aligned(
            ("arm", "metric", "better", "baseline", "value", "diff", "ci_lo", "ci_hi", "differs", "margin", "verdict"),
            (
                [
                    r["arm"],
                    r["metric"],
                    r["better"],
                    _fmt(r["baseline_value"]),
                    _fmt(r["value"]),
                    _fmt(r["diff"], True),
                    *(_fmt(x, True) for x in (r["ci"] or (None, None))),
                    _fmt(r["differs"]),
                    _fmt(r["margin_abs"]),
                    r["verdict"],
                ]
                for r in rows
            ),
        )
        out += ["", "Verdicts"]
        for r in rows:
            if r["verdict"] == "insufficient_data":
                out.append(f"  {r['arm']} vs {r['baseline']}: {r['metric']}: insufficient_data (no data in an arm)")
            else:
                lo, hi = r["improvement_ci"]
                out.append(
                    f"  {r['arm']} vs {r['baseline']}: {r['metric']}: {r['verdict']} (improvement interval "
                    f"[{lo:+.4f}, {hi:+.4f}], -margin {-r['margin_abs']:+.4f})"
                )
    for name, title in (("cached_ratio", "cached ratio bucket"), ("preempt_window", "preempt_window")):
        out += ["", f"By arm and {title} (ttft_p50 in seconds; missing_rate: TTFT unknown)"]
        out += _aligned(
            ("arm", "bucket", *TABLE_COLUMNS),
            ([r["arm"], r["bucket"], *(_fmt(r[k]) for k in TABLE_COLUMNS)] for r in report["tables"][name]),
        )
    out += ["", report["rule"]]
    return "\n".join(out) + "\n"


# -- the plot ---------------------------------------------------------------------------------------------------
def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """A PNG: per cached-ratio bucket the requests' share and TTFT p50 per arm; per compared metric the
    improvement interval of each arm (better is up) against -margin. Raises ``ReportError`` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError(f"--plot needs matplotlib ({exc}): pip install matplotlib") from None
    arms = report["settings"]["arms"]
    metrics = report["settings"]["metrics"]
    rows = report["tables"]["cached_ratio"]
    cols = max(2, len(metrics))
    fig = Figure(figsize=(max(10.0, 2.2 * cols), 8.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, cols)
    top = [fig.add_subplot(grid[0, : cols // 2]), fig.add_subplot(grid[0, cols // 2 :])]
    width = 0.8 / len(arms)
    for ax, key, label in ((top[0], "share", "share of the arm's requests"), (top[1], "ttft_p50", "TTFT p50 (s)")):
        for i, arm in enumerate(arms):
            heights = [
                next((r[key] for r in rows if r["arm"] == arm and r["bucket"] == b), None) for b in CACHED_BUCKETS
            ]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(CACHED_BUCKETS))]
            ax.bar(xs, [math.nan if h is None else h for h in heights], width, label=arm)
        ax.set_xticks(range(len(CACHED_BUCKETS)), CACHED_BUCKETS)
        ax.set_xlim(-0.5, len(CACHED_BUCKETS) - 0.5)
        ax.set_xlabel("cached ratio bucket")
        ax.set_ylabel(label)
        ax.legend()
    others = [a for a in arms if a != report["settings"]["baseline"]]
    for j, metric in enumerate(metrics):
        ax = fig.add_subplot(grid[1, j])
        ax.axhline(0.0, color="black", linewidth=0.8)
        for i, arm in enumerate(others):
            r = next(c for c in report["comparisons"] if c["arm"] == arm and c["metric"] == metric)
            if r["improvement_ci"] is None:
                continue
            lo, hi = r["improvement_ci"]
            ax.errorbar(
                [i],
                [r["improvement"]],
                yerr=[[r["improvement"] - lo], [hi - r["improvement"]]],
                fmt="o",
                capsize=4,
                color=VERDICT_COLORS[r["verdict"]],
            )
            ax.axhline(-r["margin_abs"], color="red", linestyle="--", linewidth=0.8)
        verdicts = [
            next(c["verdict"] for c in report["comparisons"] if c["arm"] == a and c["metric"] == metric) for a in others
        ]
        ax.set_xticks(range(len(others)), [f"{a}\n{v}" for a, v in zip(others, verdicts, strict=True)], fontsize=8)
        ax.set_xlim(-0.5, max(len(others), 1) - 0.5)
        ax.set_title(metric, fontsize=9)
        if j == 0:
            ax.set_ylabel(f"improvement vs {report['settings']['baseline']}\n(better is up; dashed: -margin)")
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise ReportError(f"--plot {path}: {exc.strerror or exc}") from None


# -- the command ------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kv-epp experiment report``'s arguments."""
    parser.add_argument("logs", nargs="*", metavar="LOG", help="decision log files (JSON lines, contract v1)")
    parser.add_argument("--log", action="append", default=[], metavar="LOG", help="a decision log too (repeatable)")
    parser.add_argument(
        "--baseline", metavar="ARM", help="the arm the others are compared with (default: the first arm by name)"
    )
    parser.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help=f"compare only this metric (repeatable; default all: {', '.join(METRICS)})",
    )
    parser.add_argument(
        "--margin",
        type=float,
        metavar="M",
        default=DEFAULT_MARGIN,
        help="non-inferiority margin: absolute for ratios and rates (0.02: 2 points), relative to the baseline's"
        " value for latencies (0.02: 2%%)",
    )
    parser.add_argument(
        "--margin-for",
        action="append",
        metavar="METRIC=VALUE",
        help="one metric's margin, in --margin's terms (repeatable)",
    )
    parser.add_argument(
        "--confidence", type=float, default=DEFAULT_CONFIDENCE, metavar="LEVEL", help="interval level (0.95)"
    )
    parser.add_argument("--bootstrap", type=int, default=DEFAULT_RESAMPLES, metavar="N", help="resamples (2000)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (0)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="also write a PNG of the buckets and the intervals")


def _margin(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ReportError(f"{flag}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ReportError(f"{flag}: {text!r}: a margin is a number >= 0")
    return value


def options_from_args(args: argparse.Namespace) -> ReportOptions:
    """The options of ``add_arguments``' flags; raises ``ReportError`` on a bad value or an unknown metric."""
    known = ", ".join(METRICS)
    metrics = tuple(dict.fromkeys(args.metric or METRICS))
    for m in metrics:
        if m not in METRICS:
            raise ReportError(f"--metric {m}: unknown metric (known: {known})")
    margins: dict[str, float] = {}
    for item in args.margin_for or ():
        name, sep, value = item.partition("=")
        if not sep or name not in METRICS:
            raise ReportError(f"--margin-for {item}: expected METRIC=VALUE with METRIC one of {known}")
        margins[name] = _margin(value, f"--margin-for {name}")
    if not 0 < args.confidence < 1:
        raise ReportError(f"--confidence {args.confidence}: expected a level between 0 and 1")
    if args.bootstrap < 1:
        raise ReportError(f"--bootstrap {args.bootstrap}: expected at least 1 resample")
    return ReportOptions(
        baseline=args.baseline,
        metrics=metrics,
        margin=_margin(str(args.margin), "--margin"),
        margins=margins,
        confidence=args.confidence,
        resamples=args.bootstrap,
        seed=args.seed,
    )


def run_report(args: argparse.Namespace) -> str:
    """``kv-epp experiment report``: the text (or JSON) to print; writes ``--plot``. Raises ``ReportError``."""
    options = options_from_args(args)
    logs = [*args.logs, *args.log]
    if not logs:
        raise ReportError("no decision log given: kv-epp experiment report LOG [LOG ...]")
    records, problems = load_records(logs)
    report = build_report(records, problems, options, logs)
    if args.plot:
        write_plot(report, args.plot)
    return json.dumps(report, indent=2) + "\n" if args.json else render_text(report)
