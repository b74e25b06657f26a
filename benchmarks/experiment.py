"""Session-level experiments, end to end: the picker assigns sessions to arms, writes its decision log, and
``kv-epp experiment report`` decides (docs/experiments.md).

    python -m benchmarks.experiment ab [--engines sim|vllm] [--seed 0] [--separate-seeds 3] [--out DIR]
    python -m benchmarks.experiment aa [--seeds 20] [--out DIR]

``ab``: ``round_robin`` (the picker's RoundRobin, Tier 4 off) against ``kv_cost`` (the cost model), 50/50 by
session, in one run over the same engines. On the simulator the traffic is S1 (seed 003's prefix repetition:
160 documents asked about 3 times each; a document's requests are one session, sent with ``x-session-id``).
Then each policy runs alone, ``--separate-seeds`` times, through the same plumbing (the picker, Envoy's response
mode ``full``, the decision log: an experiment of one arm), and the A/B's per-arm estimates are set beside the
alone runs' spread (``agreement``). With ``--engines vllm``: real vLLM (the CPU build, the real-engine tier's
tiny model), the ``pressured`` regime's multi-turn chat (sessions sent with ``x-session-id``), the A/B run and
each policy alone once, on the same two engines with their caches reset in between.

``aa``: two arms with the same policy (``kv_cost``) on S1, ``--seeds`` seeds (a different trace and salt each);
counts the seeds in which the report claims a difference at the 95% level (``differs``), per metric.

Every run writes ``results.json`` and ``results.md`` to ``--out`` (default: a new temporary directory), and
the decision logs and the report's JSON and PNG beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.policies import POLICIES, PolicySpec
from benchmarks.report import policy_figures
from benchmarks.routing import machine_description, run_policy
from benchmarks.scenarios import DEFAULT_TIME_SCALE, SCENARIOS, Scenario, seed003
from benchmarks.stack import make_workdir
from benchmarks.trace import TraceRecord
from benchmarks.workloads import prefix_repetition

ROOT = Path(__file__).resolve().parents[1]
ROUND_ROBIN_ARM = {"selection_strategy": "RoundRobin", "kv_cache_index": {"enabled": False}}
AB_ARMS = {"round_robin": ROUND_ROBIN_ARM, "kv_cost": {}}
AA_ARMS: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
SESSION_HEADER = "x-session-id"
DOCUMENT_KEY_CHARS = 256  # S1's prompt starts with its document (3,072 tokens): this much of it names the document


def with_document_sessions(scenario: Scenario) -> Scenario:
    """S1's records, each sent with ``x-session-id`` naming its document (the requests that share a prefix)."""
    out: list[TraceRecord] = []
    for r in scenario.records:
        text = str(r.body.get("prompt") or r.body.get("messages", [{}])[0].get("content", ""))
        doc = hashlib.blake2b(text[:DOCUMENT_KEY_CHARS].encode(), digest_size=6).hexdigest()
        out.append(dataclasses.replace(r, headers={SESSION_HEADER: f"doc-{doc}"}))
    return dataclasses.replace(scenario, records=out)


def experiment_policy(base: PolicySpec, arms: dict[str, Any], log: Path, salt: str) -> PolicySpec:
    """``base`` with ``experiments`` on (``arms``, the decision log at ``log``) and Envoy's response mode ``full``
    (the picker reads every response's usage, its first byte and its end)."""
    picker = {
        **dict(base.picker or {}),
        "experiments": {"enabled": True, "salt": salt, "decision_log": str(log), "arms": arms},
    }
    return dataclasses.replace(base, name="experiment", picker=picker, envoy={**base.envoy, "response_mode": "full"})


def report(logs: list[Path], out: Path, baseline: str, margin: float = 0.02) -> dict[str, Any]:
    """``kv-epp experiment report`` on ``logs`` (JSON, and its PNG and text beside it)."""
    argv = [sys.executable, "-m", "picker", "experiment", "report", "--baseline", baseline, "--margin", str(margin)]
    for log in logs:
        argv += ["--log", str(log)]
    text = subprocess.run([*argv, "--plot", str(out.with_suffix(".png"))], capture_output=True, text=True)
    js = subprocess.run([*argv, "--json"], capture_output=True, text=True)
    if text.returncode or js.returncode:  # the runs' logs stay: the report can be made again from them
        why = (text.stderr or js.stderr).strip()[-2000:]
        print(f"report failed ({why}); again with: {' '.join(argv)}", flush=True)
        return {"error": why, "argv": argv}
    out.with_suffix(".txt").write_text(text.stdout)
    out.write_text(js.stdout)
    data: dict[str, Any] = json.loads(js.stdout)
    return data


def separate_figures(
    results: Any, before: Any, after: Any, names: Any, wall: float, scenario: Scenario
) -> dict[str, Any]:
    f = policy_figures(
        results, before, after, names, bound=1.0, target_rate=scenario.target_rate, time_scale=scenario.time_scale,
        wall_duration_s=wall, window_s=10.0,
    )  # fmt: skip
    return {
        "gateway_cached_share": f["gateway_cached_share"],
        "engine_hit_rate": f["hit_rate"],
        "ttft_ms": f["ttft_ms"],
        "ttft_from_arrival_ms": f["ttft_from_arrival_ms"],
        "success_rate": f["success_rate"],
    }


# -- the simulator -----------------------------------------------------------------------------------
def sim_scenario(name: str, time_scale: float, seed: int, rate: float | None) -> Scenario:
    """The simulator's traffic: ``name``'s scenario, S1 at ``rate`` requests/s when given."""
    if rate is not None:
        if name != "seed003":
            raise SystemExit("--rate applies to the seed003 scenario")
        return with_document_sessions(seed003(time_scale, seed, rate=rate))
    return with_document_sessions(SCENARIOS[name](time_scale, seed))


def doubled(scenario: Scenario, seed: int) -> Scenario:
    """S1 twice over: twice the documents at twice the rate on twice the replicas, so that each of two arms on
    half of the replicas gets what one policy alone gets in S1."""
    p = scenario.params
    records = prefix_repetition(
        p["prefix_len"], p["suffix_len"], p["output_len"], 2 * p["num_prefixes"], p["prompts_per_prefix"],
        rate=2 * p["rate"], seed=seed,
    )  # fmt: skip
    return with_document_sessions(
        dataclasses.replace(
            scenario, name=f"{scenario.name}-doubled", replicas=2 * scenario.replicas, records=records,
            rate=2 * p["rate"], max_concurrency=2 * scenario.max_concurrency,
            params={**p, "num_prefixes": 2 * p["num_prefixes"], "rate": 2 * p["rate"]},
        )
    )  # fmt: skip


def run_ab_sim(
    seed: int,
    separate_seeds: int,
    out: Path,
    time_scale: float,
    scenario_name: str,
    rate: float | None = None,
    separate_pools: bool = False,
) -> dict[str, Any]:
    scenario = sim_scenario(scenario_name, time_scale, seed, rate)
    work = make_workdir("kv-epp-experiment-ab-")
    log = out / f"decisions-ab-seed{seed}.jsonl"
    arms: dict[str, Any] = AB_ARMS
    if separate_pools:  # each arm on replicas of its own: no shared queue, no shared cache
        scenario = doubled(scenario, seed)
        half = scenario.replicas // 2
        names = [f"sim-{i}" for i in range(scenario.replicas)]
        arms = {
            "round_robin": {**ROUND_ROBIN_ARM, "endpoints": names[:half]},
            "kv_cost": {"endpoints": names[half:]},
        }
    policy = experiment_policy(POLICIES["kv_cost"], arms, log, salt=f"ab-{seed}")
    print(f"[ab] {scenario_name} seed {seed}: round_robin vs kv_cost, 50/50 by document session ...", flush=True)
    pr = asyncio.run(run_policy(scenario, policy, work))
    ab_client = separate_figures(pr.results, pr.before, pr.after, pr.url_names, pr.wall_duration_s, scenario)
    rep = report([log], out / f"report-ab-seed{seed}.json", baseline="round_robin")
    separate: dict[str, list[dict[str, Any]]] = {name: [] for name in AB_ARMS}
    for s in range(separate_seeds):
        sc = sim_scenario(scenario_name, time_scale, seed + s, rate)
        for name, arm in AB_ARMS.items():
            # the same plumbing as the A/B (the picker, Envoy's response mode full, the decision log), one arm
            one = out / f"decisions-{name}-alone-seed{seed + s}.jsonl"
            alone = experiment_policy(POLICIES["kv_cost"], {name: arm}, one, salt=f"alone-{seed + s}")
            print(f"[ab] separately: {name} alone, {scenario_name} seed {seed + s} ...", flush=True)
            r = asyncio.run(run_policy(sc, alone, work))
            figures = separate_figures(r.results, r.before, r.after, r.url_names, r.wall_duration_s, sc)
            figures["report"] = report([one], out / f"report-{name}-alone-seed{seed + s}.json", baseline=name)
            separate[name].append(figures)
    return {
        "seed": seed, "separate_pools": separate_pools, "arms": arms, "report": rep,
        "experiment_client_side": ab_client, "separate": separate, "agreement": agreement(rep, separate),
    }  # fmt: skip


AGREEMENT_METRICS = ("hit_ratio", "ttft_p50", "ttft_p99")


def agreement(rep: dict[str, Any], separate: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm and metric: the A/B's estimate beside the separate runs' [min, median, max], and whether it lies
    within that spread."""
    out: dict[str, Any] = {}
    for arm, runs in separate.items():
        for metric in AGREEMENT_METRICS:
            est = (rep.get("arms", {}).get(arm) or {}).get(metric)
            alone = [((r.get("report") or {}).get("arms", {}).get(arm) or {}).get(metric) for r in runs]
            sp = spread(alone)
            within = est is not None and sp is not None and sp[0] <= est <= sp[2]
            out[f"{arm}.{metric}"] = {"experiment": est, "alone_min_median_max": sp, "within": within}
    return out


def run_aa_sim(seeds: int, out: Path, time_scale: float, scenario_name: str) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    work = make_workdir("kv-epp-experiment-aa-")
    for seed in range(seeds):
        scenario = with_document_sessions(SCENARIOS[scenario_name](time_scale, seed))
        log = out / f"decisions-aa-seed{seed}.jsonl"
        policy = experiment_policy(POLICIES["kv_cost"], AA_ARMS, log, salt=f"aa-{seed}")
        print(f"[aa] seed {seed}: kv_cost vs kv_cost ...", flush=True)
        asyncio.run(run_policy(scenario, policy, work))
        rep = report([log], out / f"report-aa-seed{seed}.json", baseline="a")
        runs.append({"seed": seed, "report": rep})
        print(f"[aa] seed {seed}: differs {differs(rep)}", flush=True)
    counts: dict[str, int] = {}
    for r in runs:
        for metric, d in differs(r["report"]).items():
            counts[metric] = counts.get(metric, 0) + int(bool(d))
    return {"seeds": seeds, "runs": runs, "claims": counts}


# -- real vLLM ---------------------------------------------------------------------------------------
def run_ab_vllm(seed: int, out: Path, sessions: int) -> dict[str, Any]:
    from benchmarks.real_engines import REGIMES, regime_trace, reset_caches, run_once, start_real

    regime = dataclasses.replace(REGIMES["pressured"], sessions=sessions)
    trace = [dataclasses.replace(r, headers={SESSION_HEADER: r.session or ""}) for r in regime_trace(regime, seed)]
    work = make_workdir("kv-epp-experiment-vllm-")
    log = out / f"decisions-ab-vllm-seed{seed}.jsonl"
    policy = experiment_policy(POLICIES["kv_cost"], AB_ARMS, log, salt=f"vllm-{seed}")
    alone = {
        name: dataclasses.replace(
            experiment_policy(POLICIES["kv_cost"], {name: arm}, out / f"decisions-{name}-alone-vllm-seed{seed}.jsonl",
                              salt=f"alone-vllm-{seed}"),
            name=f"{name}_alone",
        )
        for name, arm in AB_ARMS.items()
    }  # fmt: skip
    engines = start_real(regime, work)
    runs: dict[str, Any] = {}
    try:
        for p in (policy, *alone.values()):  # the same plumbing each time: the picker, response mode full
            reset_caches(engines)
            print(f"[vllm] {p.name}: {len(trace)} requests of {sessions} sessions ...", flush=True)
            runs[p.name] = asyncio.run(run_once(p, engines, trace, work / p.name))
            r = runs[p.name]
            print(f"[vllm] {p.name}: cached share {r['engine_cached_share']}, TTFT {r['ttft_from_arrival_ms']}")
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop()
    rep = report([log], out / f"report-ab-vllm-seed{seed}.json", baseline="round_robin")
    separate = {
        name: [{"report": report([out / f"decisions-{name}-alone-vllm-seed{seed}.jsonl"],
                                 out / f"report-{name}-alone-vllm-seed{seed}.json", baseline=name)}]
        for name in AB_ARMS
    }  # fmt: skip
    return {"seed": seed, "regime": dataclasses.asdict(regime), "report": rep, "runs": runs,
            "separate": separate, "agreement": agreement(rep, separate)}  # fmt: skip


# -- summaries ---------------------------------------------------------------------------------------
def differs(rep: dict[str, Any]) -> dict[str, bool]:
    """Per metric: does the report's interval of the difference exclude 0 (an A/A test counts these)."""
    return {c["metric"]: bool(c.get("differs")) for c in rep.get("comparisons", [])}


def spread(values: list[float | None]) -> list[float] | None:
    v = [x for x in values if x is not None]
    return [min(v), statistics.median(v), max(v)] if v else None


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Experiment benchmark: {doc['mode']}", "", f"Machine: {doc['machine']}", ""]
    if doc["mode"] == "aa":
        aa = doc["aa"]
        lines.append(f"A/A, {aa['seeds']} seeds, claims of a difference at the 95% level per metric:")
        lines += [f"- {m}: {n} of {aa['seeds']}" for m, n in sorted(aa["claims"].items())]
        return "\n".join(lines) + "\n"
    for key in ("ab", "ab_vllm"):
        ab = doc.get(key)
        if ab is None:
            continue
        lines += [
            f"## {key}",
            "",
            "| arm | metric | diff | 95% CI | differs | verdict |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for c in ab["report"].get("comparisons", []):
            ci = c.get("ci") or [None, None]
            lines.append(
                f"| {c['arm']} | {c['metric']} | {c.get('diff')} | {ci} | {c.get('differs')} | {c.get('verdict')} |"
            )
        lines += ["", "| arm.metric | experiment | alone [min, median, max] | within |", "| --- | --- | --- | --- |"]
        for k, a in ab.get("agreement", {}).items():
            lines.append(f"| {k} | {a['experiment']} | {a['alone_min_median_max']} | {a['within']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiment", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("mode", choices=("ab", "aa"))
    ap.add_argument("--engines", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=20, help="aa: how many seeds")
    ap.add_argument("--separate-seeds", type=int, default=3, help="ab on the simulator: separate runs per policy")
    ap.add_argument("--sessions", type=int, default=64, help="ab on vLLM: sessions of the pressured regime")
    ap.add_argument("--scenario", choices=("seed003", "tiny"), default="seed003", help="simulator: the traffic")
    ap.add_argument("--rate", type=float, default=None, help="ab: S1 at this arrival rate (req/s) instead of 10")
    ap.add_argument(
        "--separate-pools", action="store_true",
        help="ab on S1: each arm on replicas of its own (S1 doubled: twice the documents, rate and replicas)",
    )  # fmt: skip
    ap.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out: Path = args.out or make_workdir(f"kv-epp-experiment-{args.mode}-out-")
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"mode": args.mode, "engines": args.engines, "machine": machine_description()}
    if args.mode == "aa":
        doc["aa"] = run_aa_sim(args.seeds, out, args.time_scale, args.scenario)
    elif args.engines == "sim":
        doc["ab"] = run_ab_sim(
            args.seed, args.separate_seeds, out, args.time_scale, args.scenario, args.rate, args.separate_pools
        )
    else:
        doc["ab_vllm"] = run_ab_vllm(args.seed, out, args.sessions)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(markdown(doc))
    print(f"results: {out / 'results.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
