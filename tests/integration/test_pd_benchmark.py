"""``python -m benchmarks.pd --quick``'s P/D arm end to end on real processes: four simulated engines (NIXL), a
``kv-epp pd-sidecar`` in front of each decode engine, the kv-listener, the picker with ``disaggregation`` on and
the real Envoy. Both decision types happen (long prompts prefilled remotely, short ones decoded locally), every
stream completes, the decode engines load KV instead of prefilling it. No latency assertions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.pd import QUICK, Arm, figures, run_arm

pytestmark = pytest.mark.envoy  # benchmarks.pd starts the real Envoy


def test_quick_pd_arm(tmp_path: Path) -> None:
    run = asyncio.run(run_arm(Arm("pd", prefill_replicas=2, min_uncached_tokens=512), QUICK, 0, tmp_path))
    f = figures(run)
    assert f["success_rate"] == 1.0, f["errors"]
    assert all(r.error is None and r.completion_tokens for r in run.results)  # every stream ended with [DONE]
    kinds = {rec.extra["class"] for rec in run.records}
    assert kinds == {"stream", "long"}
    decisions = f["decisions"]
    assert decisions.get("prefill-decode/cost", 0) > 0, decisions
    assert decisions.get("decode-only/below_threshold", 0) > 0, decisions
    assert sum(decisions.values()) == len(run.records)
    assert 0 < f["prefill_leg_share"] < 1
    assert f["roles"] == {"sim-0": "prefill", "sim-1": "prefill", "sim-2": "decode", "sim-3": "decode"}
    prefill, decode = ("sim-0", "sim-1"), ("sim-2", "sim-3")
    held = sum(run.engines[n]["kv_sim_kv_transfers_held_total"] for n in prefill)
    loads = sum(run.engines[n]["kv_sim_kv_loads_total"] for n in decode)
    assert held == decisions["prefill-decode/cost"] == loads  # every prefill leg was read by its decode engine
    assert sum(r.prefill == "remote" for r in run.results) == held  # the sidecar's x-kv-epp-prefill: remote
    assert sum(run.engines[n]["kv_sim_kv_load_failures_total"] for n in decode) == 0
    assert sum(run.engines[n]["vllm:generation_tokens_total"] for n in prefill) == held  # one token per leg
    assert f["itl_ms"]["gaps"] > 0 and f["itl_ms"]["p50"] is not None
