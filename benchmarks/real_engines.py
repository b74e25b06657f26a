"""Routing on real engines: the routing harness's policies in front of real vLLM (the CPU build).

    python -m benchmarks.real_engines [--regimes pressured,low] [--policies round_robin,kv_cost] [--repeats 2]
        [--engines vllm|sim] [--seed 0] [--out DIR]

Two engines (``benchmarks.vllm_engine``: the tiny model, pages of 32 tokens), started once per regime; the
same multi-tenant chat trace (system prompts shared across sessions, each session's history growing turn by
turn, sessions arriving at a fixed rate: an open loop) through each policy, **interleaved** (A, B, A, B) with
the engines' prefix caches reset between runs (dev mode's ``/reset_prefix_cache``); the picker and the
listener are fresh for every run. Two regimes, reported apart (docs/real-engines.md):

- ``pressured``: 8 long system prompts, a cache bounded by ``--num-gpu-blocks-override`` below what one
  engine needs to hold them all: where a router that keeps each prompt on one engine gains;
- ``low``: 3 system prompts and a cache that holds everything: round robin is strong; the claim is "no worse".

Per run: the engines' own cached share (``usage.prompt_tokens_details.cached_tokens`` over prompt tokens, and
``vllm:prefix_cache_hits_total`` / ``queries_total``), TTFT p50/p99 from the scheduled arrival to the first
streamed content chunk (and from send), end-to-end latency, run time, requests per engine (the engines'
``vllm:request_success_total``), Tier 4's predicted cached tokens against the delivered ones, the picker's
fitted TTFT model beside the engine's prefill cost measured directly (an uncached and a cached prompt), and the
CPU seconds of the picker. Then per policy the median and the spread (min-max) over the repeats, and the checks
of issue 20 in every repeat.

``--engines sim`` runs the same traces on the simulator (``benchmarks.engine_sim``) configured with the figures
measured on vLLM, for the side-by-side comparison of docs/real-engines.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.loadgen import parse_prometheus_text, run_trace, scrape_prefix_cache_counters
from benchmarks.policies import PolicySpec, parse_policies
from benchmarks.report import policy_figures
from benchmarks.routing import PolicyStack, machine_description
from benchmarks.stack import make_workdir
from benchmarks.trace import TraceRecord
from benchmarks.vllm_engine.process import MODEL_NAME, VllmConfig, VllmProcess, ensure_model, start_engines
from benchmarks.workloads import multi_turn_chat, random_text

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Regime:
    """One cache regime: the workload's shape and the engines' cache size."""

    name: str
    system_prompts: int
    system_words: int  # ~4 tokens each with the tiny model's tokenizer
    sessions: int
    turns: int
    session_rate: float  # sessions started per second (Poisson): the open loop
    turn_gap_s: float  # a session's next turn is due this long after its previous one was due
    cache_pages: int  # --num-gpu-blocks-override per engine (pages of 32 tokens)
    user_words: int = 12
    output_tokens: int = 16
    description: str = ""


REGIMES = {
    "pressured": Regime(
        "pressured", system_prompts=8, system_words=400, sessions=32, turns=5, session_rate=0.4, turn_gap_s=3.0,
        cache_pages=224,
        description="8 system prompts of ~1.6k tokens (~12.7k in all) and sessions of up to ~2.1k tokens; each "
        "engine caches 224 pages of 32 tokens (7,168 tokens): one engine cannot hold every prompt",
    ),
    "low": Regime(
        "low", system_prompts=3, system_words=400, sessions=32, turns=5, session_rate=0.4, turn_gap_s=3.0,
        cache_pages=2048,
        description="3 system prompts of ~1.6k tokens; each engine caches 2,048 pages (65,536 tokens): every "
        "engine can hold everything the run sends",
    ),
}  # fmt: skip
MAX_CONCURRENCY = 64
DECODE_STEPS = 32


def regime_trace(regime: Regime, seed: int) -> list[TraceRecord]:
    import random

    rng = random.Random(f"{regime.name}:{seed}")
    systems = [random_text(rng, regime.system_words) for _ in range(regime.system_prompts)]
    return multi_turn_chat(
        regime.sessions,
        systems,
        turns=(regime.turns, regime.turns),
        user_len=regime.user_words,
        output_len=regime.output_tokens,
        session_rate=regime.session_rate,
        turn_gap_s=regime.turn_gap_s,
        seed=seed,
        model=MODEL_NAME,
    )


# -- engines --------------------------------------------------------------------------------------------
def start_real(regime: Regime, log_dir: Path) -> list[VllmProcess]:
    model = ensure_model()
    configs = [VllmConfig(name=f"vllm-{i}", num_gpu_blocks=regime.cache_pages) for i in range(2)]
    return start_engines(configs, model, log_dir)


def sim_tokens(trace: list[TraceRecord]) -> int:
    """The simulator's prompt tokens for the whole trace (its own tokenizer and chat template)."""
    from benchmarks.engine_sim.tokenizer import chat_token_ids

    return sum(len(chat_token_ids(r.body["messages"], True)) for r in trace)


def sim_config(regime: Regime, trace: list[TraceRecord], measured: dict[str, Any]) -> tuple[SimConfig, dict[str, Any]]:
    """The simulator set to what was measured on vLLM for the same trace, and how it was scaled.

    The simulator's tokenizer counts about one token per word where the tiny model's BPE counts about four: a
    simulator token stands for ``ratio`` real tokens (the vLLM run's prompt tokens over the simulator's for the
    same requests). Its page is 32 real tokens' worth (``32 / ratio`` simulator tokens), its cache the same
    number of pages, its prefill cost per token the measured one times ``ratio``, its step overhead the
    measured decode step of one sequence."""
    engines = measured["prefill"]
    ms = statistics.median(e["prefill_ms_per_token"] for e in engines.values() if e.get("prefill_ms_per_token"))
    step = statistics.median(e["decode_ms_per_step"] for e in engines.values() if e.get("decode_ms_per_step"))
    real = statistics.median(r["prompt_tokens"] for r in measured["runs"] if r.get("prompt_tokens"))
    ratio = real / max(1, sim_tokens(trace))
    block = max(1, round(32 / ratio))
    cfg = SimConfig(
        model=MODEL_NAME,
        block_size=block,
        capacity_blocks=regime.cache_pages,
        prefill_ms_per_token=round(ms * ratio, 4),
        step_overhead_ms=round(step, 3),
        decode_ms_per_seq=SimConfig().decode_ms_per_seq,
        time_scale=1.0,
        max_num_seqs=32,
    )
    scaling = {"tokens_ratio": round(ratio, 3), "vllm_prefill_ms_per_token": ms, "vllm_decode_step_ms": step}
    return cfg, scaling


def start_sims(base: SimConfig, log_dir: Path) -> list[SimulatorProcess]:
    sims = []
    for i in range(2):
        cfg = dataclasses.replace(base, name=f"sim-{i}", engine_label=str(i))
        sim = SimulatorProcess(cfg, None, log_dir / f"sim-{i}.log")
        sim.start()
        sims.append(sim)
    return sims


def reset_caches(engines: Sequence[Any]) -> None:
    """Empty every engine's prefix cache between runs: vLLM's dev-mode reset (the simulator's does the same),
    whose ``AllBlocksCleared`` goes out with the next step: a request shorter than a page makes one."""
    for e in engines:
        if not e.reset_prefix_cache().get("success"):
            raise RuntimeError(f"{e.config.name} refused to reset its prefix cache (a request still running?)")
        _post(e.base_url + "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def measure_prefill(engine: Any, words: int = 400, seed: int = 12345) -> dict[str, Any]:
    """The engine's prefill cost, measured directly: one uncached prompt, then the same prompt cached; and its
    decode cost per step for one sequence (the cached prompt again, with 33 output tokens)."""
    import random

    prompt = random_text(random.Random(seed), words)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    first = _post(engine.base_url + "/v1/completions", body)
    t1 = time.perf_counter()
    _post(engine.base_url + "/v1/completions", body)
    t2 = time.perf_counter()
    _post(engine.base_url + "/v1/completions", {**body, "max_tokens": DECODE_STEPS + 1, "ignore_eos": True})
    t3 = time.perf_counter()
    usage = first.get("usage") or {}
    tokens = int(usage.get("prompt_tokens") or 0)
    uncached, cached = t1 - t0, t2 - t1
    return {
        "prompt_tokens": tokens,
        "uncached_s": round(uncached, 4),
        "cached_s": round(cached, 4),
        "prefill_ms_per_token": round((uncached - cached) * 1000 / tokens, 4) if tokens else None,
        "decode_ms_per_step": round((t3 - t2 - cached) * 1000 / DECODE_STEPS, 3),
    }


def request_counts(text: str) -> float:
    return sum(v for n, _, v in parse_prometheus_text(text) if n == "vllm:request_success_total")


async def scrape_requests(urls: Sequence[str]) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        async def one(url: str) -> tuple[str, float]:
            async with http.get(url + "/metrics") as r:
                return url, request_counts(await r.text())

        return dict(await asyncio.gather(*(one(u) for u in urls)))


def _proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# -- one run --------------------------------------------------------------------------------------------
async def run_once(
    policy: PolicySpec, engines: Sequence[Any], trace: list[TraceRecord], workdir: Path
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    stack = PolicyStack(policy, workdir)
    await asyncio.to_thread(stack.start, list(engines))
    try:
        urls = [e.base_url for e in engines]
        names = {e.base_url: e.config.name for e in engines}
        before = await scrape_prefix_cache_counters(urls)
        req_before = await scrape_requests(urls)
        picker_pid = stack.picker.process.proc.pid if stack.picker is not None else None
        cpu0 = _proc_cpu_s(picker_pid)
        t0 = time.perf_counter()
        results = await run_trace(trace, stack.url, max_concurrency=MAX_CONCURRENCY)
        wall = time.perf_counter() - t0
        cpu1 = _proc_cpu_s(picker_pid)
        after = await scrape_prefix_cache_counters(urls)
        req_after = await scrape_requests(urls)
        stats = await stack.picker_stats()
    finally:
        await asyncio.to_thread(stack.stop)
    figures = policy_figures(
        results, before, after, names, bound=1.0, target_rate=len(trace) / max(r.t for r in trace),
        time_scale=1.0, wall_duration_s=wall, window_s=10.0,
    )  # fmt: skip
    per_engine = {names[u]: int(req_after[u] - req_before.get(u, 0.0)) for u in urls}
    out = {
        "policy": policy.name,
        "requests": len(results),
        "success_rate": figures["success_rate"],
        "engine_cached_share": figures["gateway_cached_share"],  # Σ usage cached_tokens / Σ prompt_tokens
        "engine_hit_rate": figures["hit_rate"],  # Σ Δvllm:prefix_cache_hits / Σ Δqueries
        "ttft_from_arrival_ms": figures["ttft_from_arrival_ms"],
        "ttft_ms": figures["ttft_ms"],
        "latency_ms": figures["latency_ms"],
        "run_s": round(wall, 2),
        "requests_per_engine": per_engine,
        "picker_cpu_s": round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results if r.ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in results if r.ok),
        "usage_unknown": figures["usage_unknown"],
    }
    if stats is not None:
        sample = stats.get("sampled_usage") or {}
        pred = sample.get("predicted") or {}
        out["predicted_cached_tokens"] = pred.get("all_cached")
        out["picker_prompt_tokens"] = pred.get("all_prompt")
        if out["cached_tokens"] and pred.get("all_cached") is not None:
            out["predicted_vs_delivered"] = round(pred["all_cached"] / out["cached_tokens"] - 1.0, 4)
        out["ttft_model"] = stats.get("ttft_model")
        out["routing_decisions"] = (stats.get("kv_index") or {}).get("routing_decisions")
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: the median and the min-max spread of every headline figure over its repeats."""
    keys = {
        "engine_cached_share": lambda r: r["engine_cached_share"],
        "engine_hit_rate": lambda r: r["engine_hit_rate"],
        "ttft_p50_ms": lambda r: r["ttft_from_arrival_ms"]["p50"],
        "ttft_p99_ms": lambda r: r["ttft_from_arrival_ms"]["p99"],
        "latency_p50_ms": lambda r: r["latency_ms"]["p50"],
        "run_s": lambda r: r["run_s"],
        "picker_cpu_s": lambda r: r.get("picker_cpu_s"),
        "predicted_vs_delivered": lambda r: r.get("predicted_vs_delivered"),
    }
    out: dict[str, Any] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]
        row: dict[str, Any] = {"repeats": len(mine)}
        for k, f in keys.items():
            vals = [v for v in (f(r) for r in mine) if v is not None]
            row[k] = {"median": round(statistics.median(vals), 4), "min": min(vals), "max": max(vals)} if vals else None
        out[policy] = row
    return out


def checks(runs: list[dict[str, Any]], regime: str) -> list[str]:
    """Issue 20's targets, in every repeat (pair i of kv_cost with pair i of round robin)."""
    rr = [r for r in runs if r["policy"] == "round_robin"]
    kv = [r for r in runs if r["policy"].split("+")[0] == "kv_cost"]
    lines: list[str] = []
    for i, (a, b) in enumerate(zip(rr, kv, strict=False)):
        share = (b["engine_cached_share"] or 0) - (a["engine_cached_share"] or 0)
        p50 = _ratio(b["ttft_from_arrival_ms"]["p50"], a["ttft_from_arrival_ms"]["p50"])
        p99 = _ratio(b["ttft_from_arrival_ms"]["p99"], a["ttft_from_arrival_ms"]["p99"])
        pvd = b.get("predicted_vs_delivered")
        if regime == "pressured":
            ok = share >= 0.15 and p50 is not None and p50 <= 0.75 and p99 is not None and p99 <= 1.0
            lines.append(
                f"repeat {i + 1}: cached share {share * 100:+.1f} points (>= +15), TTFT p50 x{p50} (<= 0.75), "
                f"p99 x{p99} (<= 1.0): {'MET' if ok else 'NOT MET'}"
            )
        else:
            lines.append(f"repeat {i + 1}: cached share {share * 100:+.1f} points, TTFT p50 x{p50}, p99 x{p99}")
        if pvd is not None:
            lines.append(f"repeat {i + 1}: predicted vs delivered cached tokens {pvd * 100:+.2f}% (within 5%: "
                         f"{'MET' if abs(pvd) <= 0.05 else 'NOT MET'})")  # fmt: skip
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Real engines ({doc['engines']}) — {doc['machine']}", ""]
    for name, reg in doc["regimes"].items():
        lines += [f"## {name}: {reg['description']}", ""]
        lines.append(f"Engine prefill measured directly: {reg['prefill']}")
        lines.append("")
        lines.append(
            "| run | policy | cached share (usage) | hit rate (/metrics) | TTFT p50 / p99 from arrival (ms) "
            "| latency p50 (ms) | run (s) | requests per engine | predicted vs delivered | picker CPU (s) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(reg["runs"]):
            t = r["ttft_from_arrival_ms"]
            pvd = r.get("predicted_vs_delivered")
            lines.append(
                f"| {i + 1} | {r['policy']} | {_pct(r['engine_cached_share'])} | {_pct(r['engine_hit_rate'])} "
                f"| {t['p50']} / {t['p99']} | {r['latency_ms']['p50']} | {r['run_s']} | {r['requests_per_engine']} "
                f"| {'' if pvd is None else f'{pvd * 100:+.2f}%'} | {r.get('picker_cpu_s')} |"
            )
        lines.append("")
        lines.append("Median (min-max) per policy:")
        lines.append("")
        for policy, row in reg["summary"].items():
            cells = ", ".join(
                f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in row.items() if isinstance(v, dict)
            )
            lines.append(f"- {policy}: {cells}")
        fits = [r["ttft_model"] for r in reg["runs"] if r.get("ttft_model")]
        if fits:
            lines.append(f"- the picker's fitted TTFT model (last kv run): {fits[-1]}")
        lines.append("")
        lines += [f"- {c}" for c in reg["checks"]]
        lines.append("")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def with_measured_prior(policy: PolicySpec, prefill: dict[str, Any]) -> PolicySpec:
    """``policy`` with the cost model's prefill prior set to the engines' measured prefill cost (the median over
    the engines), as an operator who measured the engine would set it: a diagnostic variant, named ``+prior``."""
    if policy.picker is None or "kv_cache_index" not in policy.picker:
        return policy
    ms = statistics.median(e["prefill_ms_per_token"] for e in prefill.values() if e.get("prefill_ms_per_token"))
    kv = dict(policy.picker["kv_cache_index"])
    scoring = dict(kv.get("scoring", {}))
    scoring["cost"] = {**dict(scoring.get("cost", {})), "prior_prefill_ms_per_token": round(ms, 4)}
    kv["scoring"] = scoring
    return dataclasses.replace(
        policy,
        name=f"{policy.name}+prior",
        description=f"{policy.description}; prefill prior {ms:.4f} ms/token (measured on the engines)",
        picker={**policy.picker, "kv_cache_index": kv},
    )


def run_regime(
    regime: Regime, policies: list[PolicySpec], repeats: int, seed: int, engines_kind: str, workdir: Path,
    measured: dict[str, Any] | None = None, measured_prior: bool = False,
) -> dict[str, Any]:  # fmt: skip
    trace = regime_trace(regime, seed)
    log_dir = workdir / regime.name
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{regime.name}] starting two {engines_kind} engines ({regime.cache_pages} pages each) ...", flush=True)
    scaling: dict[str, Any] | None = None
    if engines_kind == "vllm":
        engines: list[Any] = start_real(regime, log_dir)
    else:
        if measured is None:
            raise SystemExit("--engines sim needs --measured (a vLLM run's results.json) for its calibration")
        sim, scaling = sim_config(regime, trace, measured)
        print(f"[{regime.name}] simulator {sim} scaled by {scaling}", flush=True)
        engines = start_sims(sim, log_dir)
    runs: list[dict[str, Any]] = []
    try:
        prefill = {e.config.name: measure_prefill(e) for e in engines}
        print(f"[{regime.name}] engine prefill: {prefill}", flush=True)
        if measured_prior:
            policies = [with_measured_prior(p, prefill) for p in policies]
        for rep in range(repeats):
            for policy in policies:  # interleaved: A, B, A, B
                reset_caches(engines)
                print(f"[{regime.name}] repeat {rep + 1}: {policy.name}, {len(trace)} requests ...", flush=True)
                r = asyncio.run(run_once(policy, engines, trace, log_dir / f"{policy.name}-{rep + 1}"))
                r["repeat"] = rep + 1
                runs.append(r)
                t = r["ttft_from_arrival_ms"]
                print(
                    f"[{regime.name}] {policy.name}: cached share {_pct(r['engine_cached_share'])}, hit rate "
                    f"{_pct(r['engine_hit_rate'])}, TTFT p50/p99 {t['p50']}/{t['p99']} ms, run {r['run_s']} s, "
                    f"per engine {r['requests_per_engine']}, predicted vs delivered "
                    f"{r.get('predicted_vs_delivered')}, ok {r['success_rate']}",
                    flush=True,
                )
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop()
    return {
        "description": regime.description,
        "params": dataclasses.asdict(regime),
        "requests": len(trace),
        "prefill": prefill,
        "simulator_scaling": scaling,
        "runs": runs,
        "summary": summarize(runs),
        "checks": checks(runs, regime.name),
    }


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # the regimes' finally clauses stop the engines they started


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.real_engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--regimes", default="pressured,low")
    ap.add_argument("--policies", default="round_robin,kv_cost")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", choices=("vllm", "sim"), default="vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--session-rate", type=float, default=None, help="sessions started per second (the load)")
    ap.add_argument(
        "--measured-prior",
        action="store_true",
        help="diagnostic: Tier 4 policies start their cost model at the engines' measured prefill cost",
    )
    ap.add_argument("--out", type=Path, default=Path("out/real-engines"))
    ap.add_argument("--measured", type=Path, default=None, help="with --engines sim: a vLLM run's results.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    policies = parse_policies(a.policies)
    names = [n.strip() for n in a.regimes.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGIMES]
    if unknown:
        ap.error(f"unknown regime {unknown}; known: {', '.join(REGIMES)}")
    measured_doc = json.loads(a.measured.read_text()) if a.measured else None
    workdir = make_workdir("kv-epp-real-engines-")
    doc: dict[str, Any] = {
        "engines": a.engines,
        "machine": machine_description(),
        "seed": a.seed,
        "policies": [p.name for p in policies],
        "workdir": str(workdir),
        "regimes": {},
    }
    for name in names:
        measured = (measured_doc or {}).get("regimes", {}).get(name)
        regime = REGIMES[name]
        if a.session_rate is not None:
            regime = dataclasses.replace(regime, session_rate=a.session_rate)
        doc["regimes"][name] = run_regime(
            regime, policies, a.repeats, a.seed, a.engines, workdir, measured, a.measured_prior
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    (a.out / "results.md").write_text(text)
    print()
    print(text)
    print(f"wrote {a.out}/results.json and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["REGIMES", "Regime", "main", "regime_trace", "run_once"]
