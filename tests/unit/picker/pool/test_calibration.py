"""The TTFT model's online fit recovers the coefficients of the engine that produced the times."""

from __future__ import annotations

import random

from picker.pool.calibration import TtftCalibrator, TtftSample


def test_fit_converges_to_the_generating_coefficients() -> None:
    rng = random.Random(7)
    cal = TtftCalibrator(base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5)
    for _ in range(3000):  # truth: 40 ms + 0.25 ms/token + 3 ms per decoding request, ±5% noise
        work, dec = rng.randint(0, 12_000), rng.randint(0, 30)
        ttft_ms = (40.0 + 0.25 * work + 3.0 * dec) * rng.uniform(0.95, 1.05)
        cal.observe(TtftSample(work, dec), ttft_ms / 1000.0)
    c = cal.current
    assert abs(c.prefill_ms_per_token - 0.25) < 0.02
    assert abs(c.decode_ms_per_seq - 3.0) < 1.5
    assert abs(c.base_ms - 40.0) < 40.0
    assert c.samples == 3000


def test_fit_separates_queueing_for_a_batch_slot_from_prefill_work() -> None:
    rng = random.Random(3)
    cal = TtftCalibrator(base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5, queue_ms_per_request=20.0)
    for _ in range(4000):  # truth: 20 ms + 0.05 ms/token + 150 ms per request queued ahead + 1 ms per decoding
        own, queued, dec = rng.randint(20, 6000), rng.randint(0, 8), rng.randint(0, 8)
        ttft_ms = (20.0 + 0.05 * own + 150.0 * queued + 1.0 * dec) * rng.uniform(0.97, 1.03)
        cal.note_prefill(own)
        cal.observe(TtftSample(own, dec, queued, own), ttft_ms / 1000.0)
    c = cal.current
    assert abs(c.queue_ms_per_request - 150.0) < 15.0
    assert abs(c.prefill_ms_per_token - 0.05) < 0.01
    assert 2000 < c.mean_prefill_tokens < 4000  # the mean of the requests' own uncached tokens


def test_a_per_token_cost_never_reaches_zero_and_disabled_keeps_priors() -> None:
    cal = TtftCalibrator(base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5)
    for i in range(500):  # time independent of the work: the fit must keep a positive per-token cost
        cal.observe(TtftSample(i * 10, 0), 0.020)
    assert cal.current.prefill_ms_per_token > 0.0
    off = TtftCalibrator(base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5, enabled=False)
    off.observe(TtftSample(1000, 1), 5.0)
    assert (off.current.base_ms, off.current.prefill_ms_per_token, off.current.decode_ms_per_seq) == (10.0, 0.1, 0.5)
    off.observe(TtftSample(1000, 1), -1.0)  # nonsense is ignored
    assert off.current.samples == 1
