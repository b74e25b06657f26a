"""The experiment report on synthetic decision logs (seeded): a real difference is found and judged non-inferior, a
clear regression is a regression, a tiny sample is inconclusive; A/A runs rarely differ; the session-clustered
interval is wider than a request-level one when a session's requests are alike; unknown values are never zeros;
malformed lines, sessions in two arms, the bucket bounds, the margins, the JSON, the plot and the CLI's exit codes."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from picker.experiments.report import (
    MAX_PROBLEMS,
    METRICS,
    VERDICTS,
    Problems,
    Record,
    ReportError,
    ReportOptions,
    _Sorted,
    _weighted_quantiles,
    build_report,
    load_records,
    parse_record,
    render_text,
    verdict,
)
from picker.runtime.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def line(session: str, arm: str, **fields: Any) -> dict[str, Any]:
    """One decision-log record (contract v1) with plausible defaults; ``fields`` override them."""
    usage = {
        "prompt_tokens": fields.pop("prompt", 2000),
        "cached_tokens": fields.pop("cached", 1000),
        "completion_tokens": 64,
    }
    return {
        "v": 1, "ts": 1764650000.0, "request_id": None, "session": session, "session_source": "header",
        "arm": arm, "turn": 1, "start_gap_s": None, "idle_gap_s": None, "model": "m", "endpoint": "sim-0",
        "pod": None, "namespace": None, "strategy": "KvCost", "reason": "kv_cost",
        "prompt_tokens_predicted": None, "cached_tokens_predicted": None, "status": 200, "first_byte_s": 0.05,
        "ttft_s": 0.3, "duration_s": 1.0, "complete": True, "usage": usage, "preempt_window": 0,
        **fields,
    }  # fmt: skip


def arm_lines(
    rng: random.Random, arm: str, sessions: int, *, turns: int = 5, cached: float = 0.5, spread: float = 0.25,
    ttft: float = 0.3, noise: float = 0.05,
) -> list[dict[str, Any]]:  # fmt: skip
    """``sessions`` sessions of ``turns`` requests: each session has its own cached-ratio level (mean ``cached``,
    sd ``spread``) and its own slowness, its requests vary around them by ``noise``: requests of one session are
    alike, as in a real workload (one conversation, one prefix)."""
    out = []
    for s in range(sessions):
        level = min(1.0, max(0.0, rng.gauss(cached, spread)))
        slow = rng.lognormvariate(0.0, 0.3)
        for t in range(1, turns + 1):
            prompt = rng.randint(1000, 4000)
            ratio = min(1.0, max(0.0, level + rng.gauss(0.0, noise)))
            out.append(
                line(f"{arm}-{s}", arm, turn=t, prompt=prompt, cached=int(prompt * ratio),
                     ttft_s=ttft * slow * rng.lognormvariate(0.0, noise), first_byte_s=0.1 * ttft * slow)
            )  # fmt: skip
    return out


def write(path: Path, lines: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def report(lines: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    options.setdefault("resamples", 500)
    return build_report([parse_record(x) for x in lines], Problems(), ReportOptions(**options))


def comparison(rep: dict[str, Any], metric: str, arm: str = "b") -> dict[str, Any]:
    return next(c for c in rep["comparisons"] if c["metric"] == metric and c["arm"] == arm)


def test_a_real_difference_excludes_zero_and_is_non_inferior() -> None:
    rng = random.Random(1)
    lines = arm_lines(rng, "a", 150, cached=0.4, ttft=0.4) + arm_lines(rng, "b", 150, cached=0.7, ttft=0.25)
    rep = report(lines)
    hit = comparison(rep, "hit_ratio")
    assert hit["differs"] is True and hit["ci"][0] > 0.1
    assert hit["verdict"] == "non_inferior"
    ttft = comparison(rep, "ttft_p50")
    assert ttft["better"] == "lower" and ttft["differs"] is True and ttft["ci"][1] < 0
    assert ttft["improvement_ci"] == [-ttft["ci"][1], -ttft["ci"][0]]  # oriented: lower is better, so flipped
    assert ttft["verdict"] == "non_inferior"
    assert rep["contamination"] == {"sessions": 0, "valid": True, "examples": []}


def test_a_clear_regression_is_a_regression() -> None:
    rng = random.Random(2)
    lines = arm_lines(rng, "a", 150, cached=0.7, ttft=0.25) + arm_lines(rng, "b", 150, cached=0.3, ttft=0.5)
    rep = report(lines)
    assert comparison(rep, "hit_ratio")["verdict"] == "regression"
    assert comparison(rep, "cached_ratio_mean")["verdict"] == "regression"
    assert comparison(rep, "ttft_p50")["verdict"] == "regression"
    assert comparison(rep, "ttft_p99")["verdict"] == "regression"
    assert "b vs a: hit_ratio: regression" in render_text(rep)


def test_a_tiny_sample_is_inconclusive() -> None:
    rng = random.Random(3)
    lines = arm_lines(rng, "a", 3, cached=0.5, spread=0.3) + arm_lines(rng, "b", 3, cached=0.5, spread=0.3)
    hit = comparison(report(lines), "hit_ratio")
    assert hit["verdict"] == "inconclusive"
    assert hit["differs"] is False  # and "no significant difference" is not read as "no harm"


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [(-0.8, 0.4, "non_inferior"), (-4.0, 1.0, "inconclusive"), (-5.0, -3.0, "regression")],
)
def test_the_verdict_rule_on_the_specs_examples(lo: float, hi: float, expected: str) -> None:
    assert verdict(lo, hi, 2.0) == expected  # margin 2 points, intervals in points


def test_aa_runs_rarely_differ() -> None:
    """The same generator for both arms, 20 seeds: the 95% interval excludes 0 in about 1 of 20 (5%); <= 4 is
    far outside what a working interval does by chance (P(>= 5 of 20 at 5%) ~ 1.6%) and every seed is fixed."""
    differs = {"hit_ratio": 0, "ttft_p50": 0}
    for seed in range(20):
        rng = random.Random(1000 + seed)
        lines = arm_lines(rng, "a", 80, turns=4) + arm_lines(rng, "b", 80, turns=4)
        rep = report(lines, metrics=tuple(differs), resamples=400, seed=seed)
        for metric in differs:
            differs[metric] += comparison(rep, metric)["differs"]
    assert all(n <= 4 for n in differs.values()), differs


def _width(ci: list[float]) -> float:
    return ci[1] - ci[0]


def test_clustering_gives_a_wider_interval_than_independent_requests() -> None:
    """Sessions of 20 requests with the same cached ratio (0.1 or 0.9 per session): 40 sessions are worth about 40
    observations, not 800; a request-level bootstrap (computed here) is far too narrow."""
    rng = random.Random(4)
    lines = []
    for arm in ("a", "b"):
        for s in range(40):
            level = rng.choice((0.1, 0.9))
            lines += [line(f"{arm}-{s}", arm, prompt=1000, cached=int(1000 * level)) for _ in range(20)]
    clustered = comparison(report(lines, metrics=("hit_ratio",)), "hit_ratio")["ci"]

    def hit(rs: list[dict[str, Any]]) -> float:
        return sum(x["usage"]["cached_tokens"] for x in rs) / sum(x["usage"]["prompt_tokens"] for x in rs)

    by_arm = {arm: [x for x in lines if x["arm"] == arm] for arm in ("a", "b")}
    boot = random.Random(0)
    diffs = sorted(
        hit(boot.choices(by_arm["b"], k=len(by_arm["b"]))) - hit(boot.choices(by_arm["a"], k=len(by_arm["a"])))
        for _ in range(500)
    )
    request_level = [diffs[12], diffs[487]]  # the 2.5% and 97.5% points of 500
    assert _width(clustered) > 2.5 * _width(request_level)
    # The same requests each in a session of its own: the report's interval is then a request-level one.
    alone = [{**x, "session": f"{x['session']}/{i}"} for i, x in enumerate(lines)]
    unclustered = comparison(report(alone, metrics=("hit_ratio",)), "hit_ratio")["ci"]
    assert 0.7 < _width(unclustered) / _width(request_level) < 1.4


def test_unknown_values_are_not_zeros() -> None:
    known = [line(f"s{i}", "a", prompt=1000, cached=800, ttft_s=0.2) for i in range(10)]
    unknown = [
        line("u0", "a", usage=None, ttft_s=None, complete=None, preempt_window=None),
        line("u1", "a", usage={"prompt_tokens": None, "cached_tokens": None, "completion_tokens": None}),
        line("u2", "a", usage={"prompt_tokens": 1000, "cached_tokens": None}),  # half-known: unknown
        {k: v for k, v in line("u3", "a").items() if k not in ("usage", "ttft_s")},  # absent keys: unknown
    ]
    arm = report(known + unknown)["arms"]["a"]
    assert arm["hit_ratio"] == 0.8 and arm["cached_ratio_mean"] == pytest.approx(0.8, abs=1e-9)
    assert (arm["cached_tokens"], arm["prompt_tokens"]) == (8000, 10000)
    assert arm["missing"]["usage"] == 4 / 14
    assert arm["missing"]["ttft"] == 2 / 14 and arm["ttft_p50"] == 0.2  # u1 and u2 have the default 0.3
    assert arm["missing"]["complete"] == 1 / 14 and arm["missing"]["preempt_window"] == 1 / 14
    assert arm["incomplete_rate"] == 0.0  # over the 13 with complete known
    rows = {r["bucket"]: r for r in report(known + unknown)["tables"]["cached_ratio"]}
    assert rows["unknown"]["requests"] == 4 and rows["(0.5,0.9]"]["requests"] == 10


def test_a_null_status_is_an_error_and_incomplete_counts_only_answered_requests() -> None:
    lines = [
        line("s1", "a", status=None, complete=None),
        line("s2", "a", status=503, complete=False),
        line("s3", "a", status=200, complete=False),
        line("s4", "a", status=200, complete=True),
    ]
    arm = report(lines)["arms"]["a"]
    assert arm["error_rate"] == 0.5
    assert arm["incomplete_rate"] == 0.5  # s3 of s3, s4: the 503 and the unknown status are not in it


def test_malformed_lines_are_counted_and_skipped(tmp_path: Path) -> None:
    good = line("s1", "a")
    bad = [
        "not json",
        "[1, 2]",
        json.dumps({"v": 1, "arm": "a"}),  # no session
        json.dumps({**good, "v": 2}),
        json.dumps({**good, "v": True}),
        json.dumps({**good, "arm": 7}),
        json.dumps({**good, "ttft_s": "fast"}),
        json.dumps({**good, "ttft_s": -1}),
        json.dumps({**good, "status": "200"}),
        json.dumps({**good, "complete": 1}),
        json.dumps({**good, "preempt_window": 2}),
        json.dumps({**good, "usage": {"prompt_tokens": 10, "cached_tokens": 11}}),
        json.dumps({**good, "usage": {"prompt_tokens": 1.5, "cached_tokens": 1}}),
        json.dumps({**good, "turn": "3"}),
        '{"v": 1, "session": "s", "arm": "a", "ttft_s": NaN}',
        '{"v": 1, "session": "s", "arm": "a"',  # a truncated last write
    ]
    path = write(tmp_path / "log.jsonl", [good, *bad, "", {**good, "extra": {"ignored": True}}])
    records, problems = load_records([path])
    assert len(records) == 2 and records[0] == records[1] == parse_record(good)
    assert problems.count == len(bad) and problems.omitted == 0
    assert problems.messages[0].startswith(f"{path}:2: ")
    assert f"{path}:17: " in problems.messages[-1]  # line 18 is blank: skipped, not counted


def test_the_kept_problem_messages_are_bounded(tmp_path: Path) -> None:
    path = write(tmp_path / "log.jsonl", ["x"] * (MAX_PROBLEMS + 7) + [line("s", "a")])
    records, problems = load_records([path])
    assert len(records) == 1
    assert (problems.count, len(problems.messages), problems.omitted) == (MAX_PROBLEMS + 7, MAX_PROBLEMS, 7)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="no such file"):
        load_records([tmp_path / "absent.jsonl"])


def test_sessions_in_two_arms_are_counted() -> None:
    lines = [line("s1", "a"), line("s1", "b"), line("s2", "a"), line("s2", "b"), line("s2", "a"), line("s3", "a")]
    rep = report(lines)
    assert rep["contamination"] == {"sessions": 2, "valid": False, "examples": ["s1", "s2"]}
    assert "2 session(s) in more than one arm: NOT a valid experiment" in render_text(rep)


@pytest.mark.parametrize(
    ("prompt", "cached", "bucket"),
    [
        (100, 0, "0"), (0, 0, "unknown"), (100, 1, "(0,0.5]"), (100, 50, "(0,0.5]"), (3, 1, "(0,0.5]"),
        (100, 51, "(0.5,0.9]"), (100, 90, "(0.5,0.9]"), (30, 27, "(0.5,0.9]"), (100, 91, "(0.9,1]"),
        (10**9, 9 * 10**8 + 1, "(0.9,1]"), (100, 100, "(0.9,1]"), (None, 5, "unknown"), (100, None, "unknown"),
    ],
)  # fmt: skip
def test_cached_ratio_buckets_are_exact(prompt: int | None, cached: int | None, bucket: str) -> None:
    assert Record("s", "a", prompt_tokens=prompt, cached_tokens=cached).cached_bucket == bucket


def test_the_tables_count_per_arm_and_bucket() -> None:
    lines = [
        line("s1", "a", prompt=100, cached=0, preempt_window=1),
        line("s1", "a", prompt=100, cached=50, preempt_window=0, ttft_s=0.1),
        line("s2", "a", prompt=100, cached=50, preempt_window=None, ttft_s=0.3, status=500),
        line("s3", "b", prompt=100, cached=100, ttft_s=None),
    ]
    tables = report(lines)["tables"]
    rows = {(r["arm"], r["bucket"]): r for r in tables["cached_ratio"]}
    assert len(rows) == 10  # every bucket of every arm, empty ones too
    assert rows["a", "0"]["requests"] == 1 and rows["a", "0"]["share"] == 1 / 3
    half = rows["a", "(0,0.5]"]
    # the 500's TTFT (0.3) is not a first token's: the p50 is the other request's alone
    assert (half["requests"], half["sessions"], half["ttft_p50"], half["error_rate"]) == (2, 2, 0.1, 0.5)
    assert rows["b", "(0.9,1]"]["missing_rate"] == 1.0 and rows["b", "(0.9,1]"]["ttft_p50"] is None
    assert rows["a", "unknown"]["requests"] == 0 and rows["a", "unknown"]["error_rate"] is None
    pre = {(r["arm"], r["bucket"]): r["requests"] for r in tables["preempt_window"]}
    assert pre == {("a", "0"): 1, ("a", "1"): 1, ("a", "unknown"): 1, ("b", "0"): 1, ("b", "1"): 0,
                   ("b", "unknown"): 0}  # fmt: skip


def test_an_arm_without_data_for_a_metric_is_insufficient_data() -> None:
    rng = random.Random(5)
    lines = arm_lines(rng, "a", 20) + [{**x, "ttft_s": None} for x in arm_lines(rng, "b", 20)]
    rep = report(lines)
    assert rep["arms"]["b"]["ttft_p50"] is None and rep["arms"]["b"]["missing"]["ttft"] == 1.0
    row = comparison(rep, "ttft_p50")
    assert (row["value"], row["diff"], row["ci"], row["differs"], row["verdict"]) == (
        None, None, None, None, "insufficient_data",
    )  # fmt: skip
    assert "b vs a: ttft_p50: insufficient_data" in render_text(rep)


def test_latency_margins_are_relative_to_the_baseline_and_overridable() -> None:
    rng = random.Random(6)
    lines = arm_lines(rng, "a", 30) + arm_lines(rng, "b", 30)
    rep = report(lines, margin=0.05, margins={"ttft_p99": 0.5, "error_rate": 0.001})
    base = rep["arms"]["a"]
    assert comparison(rep, "ttft_p50")["margin_abs"] == pytest.approx(0.05 * base["ttft_p50"])
    assert comparison(rep, "ttft_p99")["margin_abs"] == pytest.approx(0.5 * base["ttft_p99"])
    assert comparison(rep, "hit_ratio")["margin_abs"] == 0.05
    assert comparison(rep, "error_rate")["margin_abs"] == 0.001
    assert "ttft_p99 50% of the baseline's value" in rep["rule"] and "error_rate 0.001" in rep["rule"]


def test_the_baseline_can_be_chosen_and_must_be_an_arm() -> None:
    lines = [line("s1", "a"), line("s2", "b"), line("s3", "c")]
    rep = report(lines, baseline="b", resamples=20)
    assert {(c["arm"], c["baseline"]) for c in rep["comparisons"]} == {("a", "b"), ("c", "b")}
    with pytest.raises(ReportError, match="no such arm"):
        report(lines, baseline="z")


def test_the_bootstrap_is_reproducible_and_the_metric_choice_does_not_move_it() -> None:
    rng = random.Random(7)
    lines = arm_lines(rng, "a", 40) + arm_lines(rng, "b", 40)
    first, again = report(lines, seed=3), report(lines, seed=3)
    assert first == again
    alone = report(lines, seed=3, metrics=("hit_ratio",))
    assert comparison(alone, "hit_ratio") == comparison(first, "hit_ratio")
    assert comparison(report(lines, seed=4), "hit_ratio")["ci"] != comparison(first, "hit_ratio")["ci"]


def test_the_percentiles_are_statistics_inclusive_quantiles() -> None:
    rng = random.Random(8)
    lines = [line(f"s{i % 37}", "a", ttft_s=rng.expovariate(3.0)) for i in range(1000)]
    arm = report(lines, resamples=10)["arms"]["a"]
    cuts = statistics.quantiles([x["ttft_s"] for x in lines], n=100, method="inclusive")
    assert arm["ttft_p50"] == pytest.approx(cuts[49]) and arm["ttft_p99"] == pytest.approx(cuts[98])


def test_a_resample_weighs_each_value_by_how_often_its_session_was_drawn() -> None:
    """The blocked search agrees with the plain quantile of the expanded multiset, across block bounds."""
    rng = random.Random(9)
    for n_values, n_sessions in ((1, 1), (7, 3), (600, 50), (1500, 1500)):
        pairs = [(rng.random(), rng.randrange(n_sessions)) for _ in range(n_values)]
        s = _Sorted.of(list(pairs))
        for _ in range(5):
            w = [rng.choice((0, 0, 1, 1, 2, 3)) for _ in range(n_sessions)]
            expanded = sorted(v for v, i in pairs for _ in range(w[i]))
            got = _weighted_quantiles(s, w, [0.0, 0.5, 0.99, 1.0])
            if not expanded:
                assert got == [None] * 4
                continue
            if len(expanded) == 1:
                want = [expanded[0]] * 4
            else:
                cuts = statistics.quantiles(expanded, n=100, method="inclusive")
                want = [expanded[0], cuts[49], cuts[98], expanded[-1]]
            assert got == pytest.approx(want)


def test_large_token_counts_keep_exact_sums() -> None:
    lines = [line(f"s{i}", "a", prompt=10**9 + i, cached=10**9 - i) for i in range(50)] + [line("b1", "b")]
    arm = report(lines, resamples=10)["arms"]["a"]
    assert arm["prompt_tokens"] == sum(10**9 + i for i in range(50))
    assert arm["cached_tokens"] == sum(10**9 - i for i in range(50))


# -- the command -----------------------------------------------------------------------------------------------
@pytest.fixture
def log(tmp_path: Path) -> Path:
    rng = random.Random(10)
    return write(tmp_path / "decisions.jsonl", arm_lines(rng, "a", 40, cached=0.6) + arm_lines(rng, "b", 40))


def test_the_cli_prints_the_report(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "report", str(log), "--bootstrap", "200"]) == 0
    out = capsys.readouterr().out
    assert "contamination: 0 sessions in more than one arm" in out
    assert "Missing data" in out and "By arm and cached ratio bucket" in out and out.rstrip().endswith(".")
    assert "b vs a: hit_ratio: " in out and "Rule: " in out


def test_the_cli_json_has_the_verdicts(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "report", str(log), "--bootstrap", "200", "--json", "--metric", "hit_ratio",
                 "--metric", "ttft_p99", "--margin-for", "ttft_p99=0.1"]) == 0  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == {"v", "inputs", "settings", "arms", "contamination", "comparisons", "tables", "rule"}
    assert [c["metric"] for c in rep["comparisons"]] == ["hit_ratio", "ttft_p99"]
    assert all(c["verdict"] in VERDICTS for c in rep["comparisons"])
    assert comparison(rep, "hit_ratio")["verdict"] == "regression"  # 0.6 -> 0.5: still exit 0
    assert rep["settings"]["margins"] == {"hit_ratio": 0.02, "ttft_p99": 0.1}
    assert set(rep["arms"]["a"]) >= {*METRICS, "requests", "sessions", "preempt_rate", "missing"}


def test_the_cli_writes_a_png(log: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "report.png"
    assert main(["experiment", "report", str(log), "--bootstrap", "50", "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metric", "ttft_p95"], "--metric ttft_p95: unknown metric (known: hit_ratio, cached_ratio_mean"),
        (["--margin-for", "ttft_p99"], "expected METRIC=VALUE"),
        (["--margin-for", "ttft_p99=-1"], "a margin is a number >= 0"),
        (["--confidence", "1.5"], "--confidence 1.5"),
        (["--baseline", "z"], "--baseline z: no such arm in the logs (arms: a, b)"),
    ],
)
def test_the_cli_refuses_bad_options(
    log: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experiment", "report", str(log), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_the_logs_can_be_given_with_log_too(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "report", "--log", str(log), "--bootstrap", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["files"] == [str(log)]
    assert main(["experiment", "report"]) == 2
    assert "no decision log given" in capsys.readouterr().err


def test_the_cli_refuses_a_missing_file(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "report", str(log), str(tmp_path / "absent.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'absent.jsonl'}: no such file\n"


def test_the_cli_refuses_logs_without_a_valid_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "report", str(write(tmp_path / "bad.jsonl", ["nope"]))]) == 2
    assert "no valid records (1 malformed lines)" in capsys.readouterr().err
