"""The routing harness end to end on real processes (simulators, picker, Envoy): a tiny prefix-heavy
scenario through round robin, PrefixAwareHash and the KV-aware policy (kv-listener + Tier 4), plus a
policy whose picker refuses its config (reported "failed to start", the run goes on), then the shape and
sanity of results.json, the engine-queue figures and the checks. No timing assertions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.policies import POLICIES, parse_policies
from benchmarks.routing import run
from benchmarks.scenarios import tiny

pytestmark = pytest.mark.envoy  # benchmarks.routing.run starts the real Envoy


def test_tiny_scenario_three_policies(tmp_path: Path) -> None:
    scenario = tiny(time_scale=0.5)
    unavailable = dataclasses.replace(POLICIES["prefix_hash"], name="not_ready", unavailable_reason="not built yet")
    refuses = dataclasses.replace(POLICIES["prefix_hash"], name="refuses", picker={"selection_strategy": "NoSuchOne"})
    policies = [*parse_policies("round_robin"), refuses, *parse_policies("prefix_hash,kv_aware"), unavailable]
    doc = run(scenario, policies, tmp_path, plots=True)

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["scenario"] == "tiny"
    assert (tmp_path / "results.md").read_text().startswith("# Routing harness: tiny")
    for png in ("hit_rate_vs_bound.png", "ttft_cdf.png", "request_share_over_time.png"):
        assert (tmp_path / png).stat().st_size > 1000

    bound = on_disk["bound_hit_rate"]
    assert 0 < bound <= 1
    assert on_disk["params"]["sim"]["capacity_blocks"] == scenario.sim.capacity_blocks
    assert set(on_disk["policies"]) == {"round_robin", "refuses", "prefix_hash", "kv_aware", "not_ready"}
    assert on_disk["policies"]["not_ready"] == {"available": False, "reason": "not built yet"}  # never invented
    failed = on_disk["policies"]["refuses"]
    assert failed["available"] is False and failed["failed_to_start"] is True
    assert failed["reason"].startswith("failed to start: error: selection_strategy")  # the bad key's path
    md = (tmp_path / "results.md").read_text()
    assert "| refuses | failed to start: error: selection_strategy" in md and "## Checks" in md

    for name in ("round_robin", "prefix_hash", "kv_aware"):
        p = on_disk["policies"][name]
        for key in (
            "hit_rate", "hit_rate_vs_bound", "request_share", "ttft_ms", "latency_ms", "achieved_rate_ratio",
            "success_rate", "tokens_per_s", "gateway_cached_share",
        ):  # fmt: skip
            assert key in p, (name, key)
        assert set(p["ttft_ms"]) == {"p50", "p90", "p99"} and set(p["latency_ms"]) == {"p50", "p99"}
        assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] <= p["ttft_ms"]["p99"]
        assert set(p["request_share"]) == {"sim-0", "sim-1"}
        assert sum(p["request_share"].values()) == pytest.approx(1.0, abs=1e-3)
        assert p["success_rate"] == 1.0 and p["requests"] == len(scenario.records)
        assert 0 <= p["hit_rate"] <= bound + 1e-9
        assert p["hit_rate_vs_bound"] == pytest.approx(p["hit_rate"] / bound, abs=1e-3)
        # every request reported usage, so the gateway's cached share equals the engines' hit rate
        assert p["usage_unknown"] == 0
        assert p["gateway_cached_share"] == pytest.approx(p["hit_rate"], abs=1e-3)
        assert p["achieved_rate_ratio"] > 0 and p["tokens_per_s"] > 0
        a = p["ttft_from_arrival_ms"]
        assert a["p99"] >= p["ttft_ms"]["p99"] - 1.0  # from arrival includes the wait for a client slot
        load = p["engine_load"]
        assert load["samples"] > 0 and load["period_ms"] == 100.0 and set(load["busy_fraction"]) == {"sim-0", "sim-1"}
        assert p["busy_fraction"] == load["busy_fraction"] and 0.0 <= p["idle_while_queued"] <= 1.0
        assert all(0.0 <= v <= 1.0 for v in p["busy_fraction"].values())

    rr, ph = doc["policies"]["round_robin"], doc["policies"]["prefix_hash"]
    assert ph["hit_rate"] > rr["hit_rate"]
    assert rr["picker_stats"] is None
    assert set(ph["picker_stats"]["cached_token_counters"]) == {"series", "totals"}
    decisions = ph["picker_stats"]["routing_decisions"]
    assert decisions["total"] == len(scenario.records)
    assert all(b["in_flight_requests"] == 0 for b in ph["picker_stats"]["backend_distribution"])

    kv = doc["policies"]["kv_aware"]
    assert kv["hit_rate"] > rr["hit_rate"]
    tier4 = kv["picker_stats"]["kv_index"]["routing_decisions"]
    assert tier4["total"] == len(scenario.records) and tier4["kv_aware"] > 0  # Tier 4 really decided
