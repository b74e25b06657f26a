"""The overload benchmark's own arithmetic: the seeded schedule, the max-min fair share, the histogram quantile
it reads from the picker, and checks that fail when a figure misses (no engines, no servers)."""

from __future__ import annotations

from typing import Any

from benchmarks import overload as ov


def test_the_schedule_is_seeded_and_draws_every_class_by_its_share() -> None:
    a = ov.make_schedule(50.0, 40.0, seed=3)
    b = ov.make_schedule(50.0, 40.0, seed=3)
    assert [(r.cls, r.at, r.prompt) for r in a] == [(r.cls, r.at, r.prompt) for r in b]
    assert [r.at for r in a] != [r.at for r in ov.make_schedule(50.0, 40.0, seed=4)]
    assert all(0 <= r.at < 40.0 for r in a) and a == sorted(a, key=lambda r: r.at)
    share = {c: sum(1 for r in a if r.cls == c) / len(a) for c in ov.CLASSES}
    for cls, (want, *_rest) in ov.CLASSES.items():
        assert abs(share[cls] - want) < 0.05, (cls, share[cls], want)


def test_the_bucket_bound_is_the_first_bucket_holding_the_quantile() -> None:
    cum = {0.1: 50.0, 0.5: 98.0, 1.0: 100.0, float("inf"): 100.0}
    assert ov.bucket_bound(cum, 0.5) == 0.1
    assert ov.bucket_bound(cum, 0.99) == 1.0
    assert ov.bucket_bound({0.1: 0.0, float("inf"): 0.0}, 0.99) is None  # nothing observed


def served(cls: str, n: int) -> list[ov.Req]:
    return [ov.Req(cls, 0.0, "", status=200, complete=True, ttft_s=0.1, answered_s=0.05) for _ in range(n)]


def test_the_fair_share_gives_the_light_tenant_all_it_asks_when_it_asks_less_than_half() -> None:
    reqs = served("heavy", 30) + served("light", 10) + [ov.Req("light", 0.0, "", status=429) for _ in range(10)]
    f = ov.fairness_figures(reqs)
    # the light tenant asked for less than half of what the band dispatched, in tokens: its fair share is all of it
    assert f["light"]["fair_share_requests"] == 20.0
    assert f["light"]["share_of_fair"] == 0.5
    assert f["heavy"]["share_of_offered"] == 1.0


def result_with(critical_p99: float, late_drops: int, silent: int) -> dict[str, Any]:
    cls = {
        c: {
            "ttft_p99_s": critical_p99 if c == "critical" else 1.0,
            "dropped_without_reason": silent if c == "heavy" else 0,
            "unanswered": 0,
            "waited_past_ttl_plus_1s": late_drops if c == "sheddable" else 0,
            "served_headers_past_ttl_plus_1s": 0,
        }
        for c in ov.CLASSES
    }
    arm = {
        "arm": "token_weighted",
        "flow_control": ov.ARMS["token_weighted"],
        "classes": cls,
        "fairness": {"light": {"share_of_fair": 1.0}},
        "peak_queue_bytes": 10,
        "picker_peak_rss_mb": 100.0,
    }
    return {"unloaded_critical_ttft_p99_s": 0.2, "arms": [arm]}


def test_the_checks_pass_on_good_figures_and_fail_on_each_miss() -> None:
    assert all(ok for _, ok, _ in ov.checks(result_with(0.25, 0, 0)))
    failed = {name for name, ok, _ in ov.checks(result_with(0.31, 2, 1)) if not ok}
    assert failed == {
        "token_weighted: critical TTFT p99 <= 1.5x unloaded",
        "token_weighted: every request served or dropped with a reason",
        "token_weighted: no client waits past its TTL + 1 s for a drop",
    }
