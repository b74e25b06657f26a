"""P/D against aggregated on the same simulated replicas: ``python -m benchmarks.pd``.

    python -m benchmarks.pd [--quick] [--seeds 0,1,2] [--replicas 4] [--prefill-replicas 2]
        [--duration-s 60] [--sweep 0,256,512,1024,2048,inf | --no-sweep] [--sweep-seed 0]
        [--min-uncached-tokens 512] [--decide cost|threshold] [--decode-stall-weight 1.0]
        [--transfer-ms-per-token 0.02] [--out DIR]

Two arms on the same replicas (``--replicas`` simulated vLLM engines, identical: the NixlConnector model with
``kv_role`` both, so either arm may use any of them), cold for every run (fresh engines), through the real
Envoy, picker (Tier 4 with the cost-model scorer, fed by the kv-listener) and the engines' queues:

- ``aggregated``: every replica ``role: both``, ``disaggregation`` off: each request is prefilled and decoded
  where the picker sends it.
- ``pd``: ``--prefill-replicas`` of them ``role: prefill``, the others ``role: decode`` behind one ``kv-epp
  pd-sidecar`` each (``--kv-connector nixlv2``, the prefill endpoints its allowlist), and ``disaggregation:
  {enabled: true, min_uncached_tokens: N}``: the picker picks the decode endpoint (its sidecar) and, when the
  prompt's uncached tokens there are at least N and the cost model agrees (``--decide cost``, the picker's
  default: a remote prefill plus the transfer predicted at most 1.2x the local one plus the stall a local prefill
  imposes on the streams decoding there, weighted by ``--decode-stall-weight``; ``--decide threshold`` is llm-d's
  rule, the threshold alone), names a prefill endpoint in
  ``x-prefiller-host-port``; the sidecar runs the prefill leg there (``max_tokens`` 1, ``do_remote_decode``),
  then the decode leg on its engine with the returned ``kv_transfer_params``: the engine loads the KV
  (``transfer_ms_per_token`` per token) instead of prefilling.

The workload (``PdWorkload``, seeded): two Poisson streams over ``--duration-s`` simulated seconds, open loop
(every request is sent at its arrival time; nothing queues in the client):

- decode streams, the chat turns whose tokens users watch: short prompts (128-384 tokens), long answers
  (128-256 tokens), 6 req/s;
- long prompts, documents to summarise or RAG contexts: 2,048-8,192 tokens, short answers (8-32 tokens),
  1.6 req/s.

Why this mix: it is where prefill and decode interfere, and so what disaggregation is for. On a replica with
streams decoding, every 2,048-token chunk of a long prompt shares a step with their tokens (vLLM's chunked
prefill: decode tokens first, then prefill up to ``max_num_batched_tokens``), and the step lasts as long as its
tokens take (~0.2 s against ~12 ms of decode alone), so the streams' inter-token latency spikes once per chunk.
The load leaves every arm below saturation (~9.7k prefill tokens/s offered against ~10k/s per replica: a quarter of
the four replicas' prefill, two fifths of two prefill replicas'), so the figures compare interference, not overload;
and it is enough prefill for its chunks to be ~4% of the decode steps, so the inter-token latency's p99 sees them
(with much less prefill they are under 1% of the steps and hide below the p99). Two of four replicas prefill by
default: with one, its queue makes the cost model keep many long prompts local (on a decode replica); with three,
one decode replica carries every stream and the short prompts' own prefills. Prompts are random words (no shared
prefixes): the cache neither helps nor muddles. The seeds change every arrival time and length; several are run, and
the spread is printed.

Figures per arm (``docs/benchmarks.md`` "P/D"): inter-token latency p50/p90/p99 from the gaps between streamed
chunks at the client (all requests' gaps pooled, and the decode streams' alone), TTFT p50/p99 from send and
from arrival, output tokens/s and the achieved request rate, the success rate, the picker's P/D decisions
(``continuum_picker_disagg_decisions_total`` by type and reason) and the share of requests that took a prefill
leg, and the engines' own count of the prefill tokens computed beside decoding streams. Then the ratios P/D ÷
aggregated per seed (issue 24's targets: ITL p99 ≤ 0.6x, TTFT p99 ≤ 1.2x) and the ``min_uncached_tokens``
sweep (the P/D arm once per value, ``inf`` = never disaggregate, on ``--sweep-seed``).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``out/pd``) and prints the tables.
``--quick`` is a smoke run (8 simulated seconds, one seed, two sweep values) for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess, start_simulators
from benchmarks.loadgen import RequestResult, parse_prometheus_text, run_trace
from benchmarks.policies import POLICIES
from benchmarks.report import percentile
from benchmarks.routing import sim_listener_sources
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    ManagedProcess,
    PickerProcess,
    free_port,
    make_workdir,
    spawn_ready_line,
    start_envoy,
    start_listener,
    start_picker,
)
from benchmarks.trace import COMPLETIONS_PATH, TraceRecord
from benchmarks.workloads import random_text
from picker.api import EnvoyOptions

log = logging.getLogger(__name__)

NEVER = 10_000_000  # min_uncached_tokens that no prompt reaches: "inf" in the sweep (P/D on, never chosen)
OPEN_LOOP_CONCURRENCY = 4096  # the client's cap: far above what the arrivals keep in flight (open loop)
DEFAULT_SWEEP = "0,256,512,1024,2048,inf"
TARGET_ITL_P99 = 0.6  # issue 24: P/D's decode ITL p99 at most 0.6x aggregated's
TARGET_TTFT_P99 = 1.2  # and its TTFT p99 at most 1.2x
DECISIONS = "continuum_picker_disagg_decisions_total"
SIM_PARAMS = (
    "block_size", "capacity_blocks", "max_num_seqs", "max_num_batched_tokens", "step_overhead_ms",
    "prefill_ms_per_token", "decode_ms_per_seq", "transfer_ms_per_token", "time_scale", "kv_connector", "kv_role",
)  # fmt: skip
ENGINE_COUNTERS = (
    "kv_sim_steps_total",
    "kv_sim_decode_steps_with_prefill_total",
    "kv_sim_prefill_tokens_in_decode_steps_total",
    "kv_sim_kv_loads_total",
    "kv_sim_kv_load_failures_total",
    "kv_sim_kv_transfers_held_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)

# The replicas: the simulator's defaults (vLLM-like chunked prefill: 2,048-token budget, 0.1 ms per prefill token,
# 0.5 ms per decoding sequence) but 10 ms per step, as a GPU's decode step of an 8B model (its weights are read once
# per step), with the NixlConnector model and a KV transfer of 0.02 ms per token (the picker's prior).
PD_SIM = SimConfig(step_overhead_ms=10.0, kv_connector="nixl", kv_role="both", transfer_ms_per_token=0.02)


@dataclass(slots=True, frozen=True)
class PdWorkload:
    """Decode streams and long prompts, two Poisson processes (see the module docstring)."""

    duration_s: float = 60.0
    stream_rate: float = 6.0
    stream_prompt: tuple[int, int] = (128, 384)
    stream_output: tuple[int, int] = (128, 256)
    long_rate: float = 1.6
    long_prompt: tuple[int, int] = (2048, 8192)
    long_output: tuple[int, int] = (8, 32)
    model: str = "sim-model"

    def records(self, seed: int) -> list[TraceRecord]:
        """The trace of one seed, sorted by arrival; each record's ``extra["class"]`` is ``stream`` or ``long``."""
        rng = random.Random(seed)
        out: list[TraceRecord] = []
        for kind, rate, prompt, output in (
            ("stream", self.stream_rate, self.stream_prompt, self.stream_output),
            ("long", self.long_rate, self.long_prompt, self.long_output),
        ):
            t = rng.expovariate(rate)
            while t < self.duration_s:
                body = {
                    "model": self.model,
                    "prompt": random_text(rng, rng.randint(*prompt)),
                    "max_tokens": rng.randint(*output),
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                out.append(TraceRecord(round(t, 4), COMPLETIONS_PATH, body, extra={"class": kind}))
                t += rng.expovariate(rate)
        out.sort(key=lambda r: r.t)
        return out

    @property
    def offered_prefill_tokens_per_s(self) -> float:
        return self.stream_rate * sum(self.stream_prompt) / 2 + self.long_rate * sum(self.long_prompt) / 2


QUICK = PdWorkload(duration_s=8.0)


@dataclass(slots=True, frozen=True)
class Arm:
    """One way to run the replicas: aggregated (no prefill replicas, P/D off) or P/D."""

    name: str
    prefill_replicas: int = 0
    min_uncached_tokens: int | None = None  # None: disaggregation off
    decide: str = "cost"  # the picker's disaggregation.decide: cost (its default) or threshold (llm-d's rule)
    decode_stall_weight: float = 1.0  # the picker's disaggregation.decode_stall_weight (its default)

    @property
    def disaggregated(self) -> bool:
        return self.min_uncached_tokens is not None


def picker_config(arm: Arm) -> dict[str, Any]:
    """The picker's config for ``arm``: the routing harness's ``kv_cost`` policy (Tier 4, the cost model, the
    engines' queues) and, for P/D, ``disaggregation`` (reject when no prefill endpoint: never silent)."""
    base = POLICIES["kv_cost"].picker
    assert base is not None
    config = json.loads(json.dumps(base))  # a deep copy
    if arm.disaggregated:
        config["disaggregation"] = {
            "enabled": True,
            "min_uncached_tokens": arm.min_uncached_tokens,
            "decide": arm.decide,
            "decode_stall_weight": arm.decode_stall_weight,
        }
    return dict(config)


# -- the stack ------------------------------------------------------------------------------------------
SIDECAR_READY = "kv-epp pd-sidecar ready "


def start_sidecar(
    name: str, engine: SimulatorProcess, prefill: Sequence[str], workdir: Path
) -> tuple[ManagedProcess, str]:
    """``kv-epp pd-sidecar`` in front of ``engine`` (NIXL v2), allowing ``prefill`` (``ip:port``) as targets, on a
    port it binds itself; returns the process and its ``ip:port`` (from its ready line)."""
    argv = [
        sys.executable, "-m", "picker", "pd-sidecar", "--host", "127.0.0.1", "--port", "0",
        "--model-server-host", "127.0.0.1", "--model-server-port", str(engine.port), "--kv-connector", "nixlv2",
        "--prefill-targets", ",".join(prefill),
    ]  # fmt: skip
    mp, line = spawn_ready_line(name, argv, workdir, SIDECAR_READY)
    fields = dict(part.split("=", 1) for part in line.removeprefix(SIDECAR_READY).split() if "=" in part)
    return mp, fields["port"]


@dataclass
class ArmStack:
    """The processes of one arm: simulators, the listener, sidecars (P/D), the picker, Envoy."""

    arm: Arm
    workdir: Path
    sims: list[SimulatorProcess] = field(default_factory=list)
    sidecars: list[ManagedProcess] = field(default_factory=list)
    listener: ListenerProcess | None = None
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    backends: list[dict[str, Any]] = field(default_factory=list)

    def start(self, replicas: int, sim: SimConfig) -> None:
        self.sims = start_simulators(replicas, sim, None, self.workdir)
        n_prefill = self.arm.prefill_replicas if self.arm.disaggregated else 0
        prefill = self.sims[:n_prefill]
        for s in prefill:
            self.backends.append({"name": s.config.name, "address": s.address, "role": "prefill"})
        for s in self.sims[n_prefill:]:
            if self.arm.disaggregated:
                sidecar, address = start_sidecar(
                    f"sidecar-{s.config.name}", s, [p.address for p in prefill], self.workdir
                )
                self.sidecars.append(sidecar)
                self.backends.append({"name": s.config.name, "address": address, "role": "decode"})
            else:
                self.backends.append({"name": s.config.name, "address": s.address, "role": "both"})
        sources = sim_listener_sources(self.sims)
        self.listener = start_listener({"sources": sources}, self.workdir, name="listener")
        config = picker_config(self.arm)
        if self.arm.disaggregated:  # Envoy's response mode is none here: the picker draws no transfer sample, so
            # its prior is the engines' true transfer cost (a run with another cost is not judged by a wrong prior)
            config["disaggregation"]["transfer_ms_per_token"] = self.sims[0].config.transfer_ms_per_token
        config["pool"] = {**config.get("pool", {}), "backends": self.backends}
        config["kv_cache_index"]["event_sources"] = [
            {"backend_name": s.config.name, "endpoint": self.listener.events_url(s.config.name)} for s in self.sims
        ]
        self.picker = start_picker(config, self.workdir, name="picker")
        opts = EnvoyOptions(
            listen_port=free_port(),
            listen_address="127.0.0.1",
            admin_port=free_port(),
            **self.picker.envoy_picker_options(),
            backends=tuple(b["address"] for b in self.backends),
            max_requests=100_000,
        )
        self.envoy = start_envoy(opts, self.workdir)

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def stop(self) -> None:
        for proc in (self.envoy, self.picker, *self.sidecars, self.listener):
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop()
        for s in self.sims:
            with contextlib.suppress(Exception):
                s.stop()


# -- measuring ------------------------------------------------------------------------------------------
async def scrape(http: aiohttp.ClientSession, url: str) -> list[tuple[str, dict[str, str], float]]:
    async with http.get(url.rstrip("/") + "/metrics") as resp:
        resp.raise_for_status()
        return parse_prometheus_text(await resp.text())


def engine_counters(samples: Sequence[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for name, _, value in samples:
        if name in out:
            out[name] += value
    return out


def decision_counts(samples: Sequence[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """``decision_type/reason`` -> count, from the picker's own counter."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == DECISIONS and value:
            key = f"{labels.get('decision_type', '')}/{labels.get('reason', '')}"
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class ArmRun:
    """The raw outcome of one arm on one trace."""

    arm: Arm
    seed: int
    records: list[TraceRecord]
    results: list[RequestResult]
    wall_s: float
    decisions: dict[str, float]
    engines: dict[str, dict[str, float]]  # replica name -> Δ counters
    roles: dict[str, str]


async def run_arm(
    arm: Arm, workload: PdWorkload, seed: int, workdir: Path, replicas: int = 4, sim: SimConfig = PD_SIM
) -> ArmRun:
    """Run ``workload`` (seed ``seed``) through ``arm`` on fresh simulators; every process is stopped after."""
    records = workload.records(seed)
    run_dir = workdir / f"{arm.name}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = ArmStack(arm, run_dir)
    try:
        await asyncio.to_thread(stack.start, replicas, sim)
        assert stack.picker is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            before = {s.config.name: engine_counters(await scrape(http, s.base_url)) for s in stack.sims}
            started = time.perf_counter()
            results = await run_trace(
                records, stack.url, max_concurrency=OPEN_LOOP_CONCURRENCY, time_scale=sim.time_scale
            )
            wall = time.perf_counter() - started
            after = {s.config.name: engine_counters(await scrape(http, s.base_url)) for s in stack.sims}
            decisions = decision_counts(await scrape(http, stack.picker.admin_url))
        engines = {n: {k: after[n][k] - before[n][k] for k in ENGINE_COUNTERS} for n in after}
        roles = {b["name"]: b["role"] for b in stack.backends}
        return ArmRun(arm, seed, records, results, wall, decisions, engines, roles)
    finally:
        await asyncio.to_thread(stack.stop)


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000.0, 1)


def figures(run: ArmRun, time_scale: float = 1.0) -> dict[str, Any]:
    """The figures of one run (times in simulated ms: wall ms / ``time_scale``)."""
    scale = 1.0 / time_scale
    ok = [r for r in run.results if r.ok]
    kinds = {i: rec.extra.get("class", "") for i, rec in enumerate(run.records)}
    gaps = [g * scale for r in ok for g in r.token_gaps_s]
    stream_gaps = [g * scale for r in ok if kinds[r.index] == "stream" for g in r.token_gaps_s]
    ttft = [r.ttft_s * scale for r in ok if r.ttft_s is not None]
    arrival = [(max(0.0, r.start_s - r.scheduled_s) + r.ttft_s) * scale for r in ok if r.ttft_s is not None]
    long_ttft = [r.ttft_s * scale for r in ok if r.ttft_s is not None and kinds[r.index] == "long"]
    # the long prompts by where they were prefilled: remotely (the sidecar's x-kv-epp-prefill: remote) or locally
    long_remote = [r.ttft_s * scale for r in ok if r.ttft_s and kinds[r.index] == "long" and r.prefill == "remote"]
    long_local = [r.ttft_s * scale for r in ok if r.ttft_s and kinds[r.index] == "long" and r.prefill != "remote"]
    stream_ttft = [r.ttft_s * scale for r in ok if r.ttft_s is not None and kinds[r.index] == "stream"]
    duration = run.wall_s * scale
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    total_decisions = sum(run.decisions.values())
    pd_decisions = sum(v for k, v in run.decisions.items() if k.startswith("prefill-decode/"))
    decode_engines = [n for n, role in run.roles.items() if role != "prefill"]
    steps = sum(run.engines[n]["kv_sim_steps_total"] for n in decode_engines)
    stalled = sum(run.engines[n]["kv_sim_decode_steps_with_prefill_total"] for n in decode_engines)
    beside = sum(run.engines[n]["kv_sim_prefill_tokens_in_decode_steps_total"] for n in decode_engines)
    return {
        "requests": len(run.results),
        "success_rate": round(len(ok) / len(run.results), 4) if run.results else None,
        "errors": sorted({(r.error or "")[:120] for r in run.results if not r.ok})[:5],
        "itl_ms": {"p50": _ms(gaps, 0.5), "p90": _ms(gaps, 0.9), "p99": _ms(gaps, 0.99), "gaps": len(gaps)},
        "stream_itl_ms": {"p50": _ms(stream_gaps, 0.5), "p99": _ms(stream_gaps, 0.99)},
        "ttft_ms": {"p50": _ms(ttft, 0.5), "p99": _ms(ttft, 0.99)},
        "ttft_from_arrival_ms": {"p50": _ms(arrival, 0.5), "p99": _ms(arrival, 0.99)},
        "stream_ttft_ms": {"p50": _ms(stream_ttft, 0.5), "p99": _ms(stream_ttft, 0.99)},
        "long_ttft_ms": {"p50": _ms(long_ttft, 0.5), "p99": _ms(long_ttft, 0.99)},
        "long_ttft_by_prefill_ms": {
            "remote": {"count": len(long_remote), "p50": _ms(long_remote, 0.5), "p99": _ms(long_remote, 0.99)},
            "local": {"count": len(long_local), "p50": _ms(long_local, 0.5), "p99": _ms(long_local, 0.99)},
        },
        "output_tokens_per_s": round(output_tokens / duration, 1) if duration > 0 else None,
        "achieved_rate": round(len(ok) / duration, 3) if duration > 0 else None,
        "target_rate": round(len(run.records) / max((r.t for r in run.records), default=1.0), 3),
        "decisions": run.decisions,
        "prefill_leg_share": round(pd_decisions / total_decisions, 4) if total_decisions else 0.0,  # decided
        # the requests whose answer says a prefill leg ran (the sidecar's x-kv-epp-prefill: remote)
        "prefilled_remotely_share": round(sum(1 for r in ok if r.prefill == "remote") / len(ok), 4) if ok else 0.0,
        # the stall's cause, counted by the engines that decode: steps that carried prefill tokens beside decoding
        # streams (a remote prefill's one last token included), and those prefill tokens
        "decode_steps_with_prefill_share": round(stalled / steps, 4) if steps else None,
        "prefill_tokens_beside_decodes": int(beside),
        "engines": run.engines,
        "roles": run.roles,
        "duration_s": round(duration, 2),
    }


def ratio(pd: float | None, agg: float | None) -> float | None:
    return round(pd / agg, 3) if pd is not None and agg else None


def ratios(pd: Mapping[str, Any], agg: Mapping[str, Any]) -> dict[str, float | None]:
    """P/D ÷ aggregated of the headline figures."""
    return {
        "itl_p99": ratio(pd["itl_ms"]["p99"], agg["itl_ms"]["p99"]),
        "itl_p50": ratio(pd["itl_ms"]["p50"], agg["itl_ms"]["p50"]),
        "ttft_p99": ratio(pd["ttft_ms"]["p99"], agg["ttft_ms"]["p99"]),
        "ttft_from_arrival_p99": ratio(pd["ttft_from_arrival_ms"]["p99"], agg["ttft_from_arrival_ms"]["p99"]),
        "ttft_p50": ratio(pd["ttft_ms"]["p50"], agg["ttft_ms"]["p50"]),
        "output_tokens_per_s": ratio(pd["output_tokens_per_s"], agg["output_tokens_per_s"]),
    }


# -- the run --------------------------------------------------------------------------------------------
def parse_sweep(text: str) -> list[int]:
    """``0,512,inf`` -> thresholds (``inf``: never disaggregate)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        out.append(NEVER if part in ("inf", "Infinity") else int(part))
    return out


def _label(threshold: int) -> str:
    return "inf" if threshold >= NEVER else str(threshold)


def row(name: str, f: Mapping[str, Any]) -> str:
    d = f["decisions"]
    decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items())) or "-"
    return (
        f"| {name} | {f['itl_ms']['p50']} | {f['itl_ms']['p99']} | {f['stream_itl_ms']['p99']} | "
        f"{f['ttft_ms']['p50']} | {f['ttft_ms']['p99']} | {f['ttft_from_arrival_ms']['p99']} | "
        f"{f['output_tokens_per_s']} | {f['success_rate']} | {f['prefill_leg_share']:.0%} | "
        f"{f['prefill_tokens_beside_decodes'] / 1000:.0f}k | {decisions} |"
    )


HEADER = (
    "| run | ITL p50 ms | ITL p99 ms | stream ITL p99 ms | TTFT p50 ms | TTFT p99 ms | TTFT p99 from arrival ms | "
    "output tok/s | success | prefill legs | prefill tokens beside decodes | decisions |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def run(
    workload: PdWorkload,
    seeds: Sequence[int],
    sweep: Sequence[int],
    sweep_seed: int,
    out: Path,
    replicas: int = 4,
    prefill_replicas: int = 2,
    min_uncached_tokens: int = 512,
    decide: str = "cost",
    sim: SimConfig = PD_SIM,
    decode_stall_weight: float = 1.0,
) -> dict[str, Any]:
    """Both arms on every seed (interleaved: aggregated, P/D, next seed), then the sweep; writes the results."""
    workdir = make_workdir("kv-epp-pd-")
    aggregated = Arm("aggregated")
    pd = Arm("pd", prefill_replicas, min_uncached_tokens, decide, decode_stall_weight)
    doc: dict[str, Any] = {
        "params": {
            "workload": dataclasses.asdict(workload),
            "offered_prefill_tokens_per_s": round(workload.offered_prefill_tokens_per_s),
            "replicas": replicas,
            "prefill_replicas": prefill_replicas,
            "min_uncached_tokens": min_uncached_tokens,
            "decide": decide,
            "decode_stall_weight": decode_stall_weight,
            "seeds": list(seeds),
            "sim": {k: getattr(sim, k) for k in SIM_PARAMS},
            "picker": {"aggregated": picker_config(aggregated), "pd": picker_config(pd)},
            "workdir": str(workdir),
            "date": time.strftime("%Y-%m-%d"),
        },
        "seeds": {},
        "sweep": {},
    }
    for seed in seeds:
        per_seed: dict[str, Any] = {}
        for arm in (aggregated, pd):
            print(f"[seed {seed}] {arm.name} ...", flush=True)
            per_seed[arm.name] = figures(
                asyncio.run(run_arm(arm, workload, seed, workdir, replicas, sim)), sim.time_scale
            )
            print(HEADER.splitlines()[0] + "\n" + HEADER.splitlines()[1], flush=True)
            print(row(f"{arm.name} seed {seed}", per_seed[arm.name]), flush=True)
        per_seed["ratios"] = ratios(per_seed["pd"], per_seed["aggregated"])
        print(f"[seed {seed}] P/D ÷ aggregated: {per_seed['ratios']}", flush=True)
        doc["seeds"][str(seed)] = per_seed
    doc["summary"] = summary(doc)
    for threshold in sweep:
        arm = Arm(f"pd-min{_label(threshold)}", prefill_replicas, threshold, decide, decode_stall_weight)
        print(f"[sweep] min_uncached_tokens={_label(threshold)} (seed {sweep_seed}) ...", flush=True)
        doc["sweep"][_label(threshold)] = figures(
            asyncio.run(run_arm(arm, workload, sweep_seed, workdir, replicas, sim)), sim.time_scale
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "results.md").write_text(markdown(doc))
    return doc


def summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Per ratio: the value of every seed, the median and the range; the targets checked on the worst seed."""
    per = [s["ratios"] for s in doc["seeds"].values()]
    out: dict[str, Any] = {}
    for key in ("itl_p99", "itl_p50", "ttft_p99", "ttft_from_arrival_p99", "output_tokens_per_s"):
        values = [r[key] for r in per if r[key] is not None]
        out[key] = {
            "seeds": values,
            "median": round(statistics.median(values), 3) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
        }
    itl_worst, ttft_worst = out["itl_p99"]["max"], out["ttft_p99"]["max"]
    out["targets"] = {
        "itl_p99_at_most_0.6x": None if itl_worst is None else itl_worst <= TARGET_ITL_P99,
        "ttft_p99_at_most_1.2x": None if ttft_worst is None else ttft_worst <= TARGET_TTFT_P99,
    }
    return out


TTFT_HEADER = (
    "| run | stream TTFT p50 / p99 ms | long TTFT p50 / p99 ms | long, prefilled remotely: n, p50 / p99 ms | "
    "long, prefilled locally: n, p50 / p99 ms |\n|---|---|---|---|---|"
)


def ttft_row(name: str, f: Mapping[str, Any]) -> str:
    by = f["long_ttft_by_prefill_ms"]
    return (
        f"| {name} | {f['stream_ttft_ms']['p50']} / {f['stream_ttft_ms']['p99']} | {f['long_ttft_ms']['p50']} / "
        f"{f['long_ttft_ms']['p99']} | {by['remote']['count']}, {by['remote']['p50']} / {by['remote']['p99']} | "
        f"{by['local']['count']}, {by['local']['p50']} / {by['local']['p99']} |"
    )


def markdown(doc: Mapping[str, Any]) -> str:
    lines = [HEADER]
    runs: list[tuple[str, Mapping[str, Any]]] = []
    for seed, per in doc["seeds"].items():
        runs += [(f"aggregated, seed {seed}", per["aggregated"]), (f"P/D, seed {seed}", per["pd"])]
    lines += [row(name, f) for name, f in runs]
    lines += ["", "TTFT by request class:", "", TTFT_HEADER, *(ttft_row(name, f) for name, f in runs)]
    s = doc.get("summary") or {}
    if s:
        lines += ["", "| P/D ÷ aggregated | per seed | median | worst |", "|---|---|---|---|"]
        for key in ("itl_p99", "itl_p50", "ttft_p99", "ttft_from_arrival_p99", "output_tokens_per_s"):
            v = s[key]
            worst = v["min"] if key == "output_tokens_per_s" else v["max"]
            lines.append(f"| {key} | {', '.join(str(x) for x in v['seeds'])} | {v['median']} | {worst} |")
        t = s["targets"]
        lines.append("")
        lines.append(
            f"Targets (worst seed): ITL p99 ≤ 0.6x: {_yes(t['itl_p99_at_most_0.6x'])}; "
            f"TTFT p99 ≤ 1.2x: {_yes(t['ttft_p99_at_most_1.2x'])}"
        )
    if doc.get("sweep"):
        lines += ["", "min_uncached_tokens sweep (P/D arm):", "", HEADER]
        for label, f in doc["sweep"].items():
            lines.append(row(f"min_uncached_tokens={label}", f))
        lines += ["", TTFT_HEADER]
        lines += [ttft_row(f"min_uncached_tokens={label}", f) for label, f in doc["sweep"].items()]
    return "\n".join(lines) + "\n"


def _yes(x: bool | None) -> str:
    return "n/a" if x is None else ("met" if x else "NOT met")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.pd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 s, seed 0, sweep 512,inf")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--prefill-replicas", type=int, default=2)
    ap.add_argument("--min-uncached-tokens", type=int, default=512, help="the P/D arm's threshold")
    ap.add_argument(
        "--decide",
        choices=("cost", "threshold"),
        default="cost",
        help="the P/D arm's disaggregation.decide: cost (the picker's default) or threshold (llm-d's rule)",
    )
    ap.add_argument(
        "--decode-stall-weight",
        type=float,
        default=1.0,
        help="the P/D arm's disaggregation.decode_stall_weight (0: the request's own TTFT alone decides)",
    )
    ap.add_argument("--duration-s", type=float, default=None, help="simulated seconds of arrivals (default 60)")
    ap.add_argument("--sweep", default=DEFAULT_SWEEP, help="min_uncached_tokens values (inf: never)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-seed", type=int, default=0)
    ap.add_argument(
        "--transfer-ms-per-token",
        type=float,
        default=PD_SIM.transfer_ms_per_token,
        help="the engines' KV transfer cost",
    )
    ap.add_argument("--out", type=Path, default=Path("out/pd"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not 0 < a.prefill_replicas < a.replicas:
        ap.error("--prefill-replicas must leave at least one decode replica")
    workload = QUICK if a.quick else PdWorkload()
    if a.duration_s is not None:
        workload = dataclasses.replace(workload, duration_s=a.duration_s)
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",") if s.strip()]
    sweep = [] if a.no_sweep else parse_sweep("512,inf" if a.quick else a.sweep)
    sim = dataclasses.replace(PD_SIM, transfer_ms_per_token=a.transfer_ms_per_token)
    doc = run(
        workload,
        seeds,
        sweep,
        a.sweep_seed,
        a.out,
        a.replicas,
        a.prefill_replicas,
        a.min_uncached_tokens,
        a.decide,
        sim,
        a.decode_stall_weight,
    )
    print()
    print(markdown(doc))
    print(f"wrote {a.out}/results.json and results.md")
    return 0


__all__ = ["Arm", "PdWorkload", "figures", "main", "ratios", "run", "run_arm"]

if __name__ == "__main__":
    sys.exit(main())
