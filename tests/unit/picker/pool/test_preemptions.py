"""Preemption windows: the engine's preemption counter, read by the scrape, as exposure over a window: 1, 0 or
unknown, never a per-request flag."""

from __future__ import annotations

from picker.pool.engine_readings import preemption_total, read_signals
from picker.pool.preemptions import MAX_SAMPLES, PreemptionWindows

BODY = """# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_the_counter_is_read_from_the_scrape_summed_over_engines() -> None:
    _, expo = read_signals(BODY)
    assert preemption_total(expo) == 5.0
    _, without = read_signals("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")
    assert preemption_total(without) is None


def test_exposure_over_a_window() -> None:
    w = PreemptionWindows()
    for at, total in ((0.0, 5.0), (1.0, 5.0), (2.0, 7.0), (3.0, 7.0)):
        w.note("e", at, total)
    assert w.exposure("e", 0.0, 1.5) == 0  # no rise between the scrapes at 0 and 1
    assert w.exposure("e", 0.5, 2.5) == 1  # it rose between 1 and 2
    assert w.exposure("e", 2.0, 3.0) == 0
    assert w.exposure("e", -1.0, 3.0) is None  # no scrape before the window: not covered
    assert w.exposure("other", 0.0, 3.0) is None  # no series: unknown, not 0


def test_a_counter_that_goes_back_is_unknown_and_a_missing_one_drops_the_series() -> None:
    w = PreemptionWindows()
    w.note("e", 0.0, 9.0)
    w.note("e", 1.0, 1.0)  # the engine restarted
    assert w.exposure("e", 0.0, 1.0) is None
    w.note("e", 2.0, None)
    assert w.exposure("e", 0.0, 2.0) is None and len(w) == 0


def test_the_series_is_bounded() -> None:
    w = PreemptionWindows()
    for i in range(MAX_SAMPLES + 100):
        w.note("e", float(i), 0.0)
    assert w.exposure("e", 50.0, 60.0) is None  # the oldest samples are gone
    assert w.exposure("e", float(MAX_SAMPLES), float(MAX_SAMPLES + 50)) == 0
    w.forget("e")
    assert len(w) == 0
