"""The experiment benchmark end to end on the tiny scenario: the picker assigns document sessions to two arms
behind the real Envoy over simulated engines, writes its decision log, and ``kv-epp experiment report`` reads it;
each policy also runs alone through the same plumbing. What it asserts is the chain, not the figures."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.experiment import main


def test_the_ab_benchmark_runs_the_chain_on_the_tiny_scenario(tmp_path: Path) -> None:
    assert main(["ab", "--scenario", "tiny", "--separate-seeds", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    ab = doc["ab"]
    rep = ab["report"]
    assert "error" not in rep, rep
    assert set(rep["arms"]) == {"round_robin", "kv_cost"}
    assert rep["contamination"]["sessions"] == 0
    assert rep["inputs"]["records"] == 48 and rep["inputs"]["malformed"] == 0
    for arm in rep["arms"].values():
        assert arm["missing"]["usage"] == 0.0 and arm["missing"]["ttft"] == 0.0  # response mode full: all seen
    assert {c["metric"] for c in rep["comparisons"]} >= {"hit_ratio", "ttft_p50", "ttft_p99"}
    assert set(ab["agreement"]) == {
        f"{a}.{m}" for a in ("round_robin", "kv_cost") for m in ("hit_ratio", "ttft_p50", "ttft_p99")
    }
    for name in ("round_robin", "kv_cost"):
        (alone,) = ab["separate"][name]
        assert set(alone["report"]["arms"]) == {name}
    assert (tmp_path / "report-ab-seed0.png").read_bytes().startswith(b"\x89PNG")
    assert "| kv_cost | hit_ratio |" in (tmp_path / "results.md").read_text()
