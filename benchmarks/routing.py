"""Routing-quality harness: the same workload through each routing policy, cold, side by side.

    python -m benchmarks.routing --scenario seed003|chat-skew|churn|hot-docs|tiny|demo [--trace FILE]
        [--policies round_robin,load_only,prefix_hash,prefix_memory,kv_aware,kv_cost] [--out DIR]
        [--time-scale 0.5] [--seed 0] [--poll-ms 100]
        [--pickers N] [--shared-load off|on|both] [--baseline] [--kill-picker-at S] [--fail-open on|off]

For every policy (``benchmarks.policies.POLICIES``), in order: start fresh simulators (cold caches),
the picker (and the listener) the policy needs, and the real Envoy; scrape the engines' prefix-cache
counters; replay the trace (``benchmarks.loadgen.run_trace``) while applying the scenario's churn
events (S3: a simulator restart, a replica added to the picker's hot-reloaded config file); scrape
again; read the picker's decision counters; stop everything (by pid). While the trace runs, every pool
replica's ``vllm:num_requests_running`` / ``_waiting`` is polled each ``--poll-ms`` (wall) for the busy
fractions and ``idle_while_queued``. Then compute the docs/benchmarks.md figures (``benchmarks.report``)
against the bound of the trace itself, write ``results.json``, ``results.md`` and PNG plots into
``--out``, and print the table and the checks of issue 12 (per policy, and the scenario's goals).

With ``--pickers N`` every picker-backed policy runs N pickers behind one Envoy (``benchmarks.scale_out``;
docs/benchmarks.md, "Several pickers"): each picker's decisions are reported, and ``--kill-picker-at``
SIGKILLs one of them mid-run.

A policy whose processes refuse to start (e.g. the picker rejects a strategy it does not know yet) is
reported as "failed to start" with the error's last line, and the run goes on with the next policy.

Envoy's round robin uses a static cluster: a replica added mid-run (S3) cannot join it without an
Envoy restart, which would reset every connection; the harness starts the replica anyway (so the
same processes run) and reports that round robin did not use it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.bound import bound_hit_rate
from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess, start_simulators
from benchmarks.loadgen import (
    EngineLoadPoller,
    EngineLoadSample,
    PrefixCacheCounters,
    RequestResult,
    parse_prometheus_text,
    run_trace,
    scrape_prefix_cache_counters,
)
from benchmarks.policies import POLICIES, PolicySpec, parse_policies
from benchmarks.redis_kv_index import valkey
from benchmarks.report import (
    comparison_lines,
    failed_to_start,
    goal_checks,
    load_figures,
    markdown_table,
    policy_figures,
    restart_recovery,
    ttft_detail_table,
    unavailable,
    write_report,
)
from benchmarks.scale_out import (
    KillTarget,
    kill_and_watch,
    kill_figures,
    kill_lines,
    merge_metrics,
    per_picker_table,
    picker_report,
    scale_out_arms,
    scale_out_lines,
    scrape_picker,
    with_shares,
)
from benchmarks.scenarios import DEFAULT_TIME_SCALE, SCENARIOS, ChurnEvent, Scenario, trace_scenario
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    PickerProcess,
    free_port,
    make_workdir,
    parse_envoy_stats,
    start_envoy,
    start_listener,
    start_picker,
)
from picker.api import EnvoyOptions

log = logging.getLogger(__name__)

DEFAULT_POLICIES = "round_robin,load_only,prefix_hash,prefix_memory,kv_aware,kv_cost"


def sim_listener_sources(sims: Sequence[SimulatorProcess]) -> list[dict[str, Any]]:
    """The kv-listener's sources for simulated engines: each one's ZMQ events and replay endpoint, model and page."""
    return [
        {
            "backend_name": s.config.name,
            "engine": "vllm",
            "model": s.config.model,
            "block_size": s.config.block_size,
            "zmq_endpoint": s.kv_events_endpoint,
            "replay_endpoint": s.replay_endpoint,
        }
        for s in sims
    ]


class PolicyStartError(RuntimeError):
    """A policy's processes (picker, listener, Envoy) did not start; the message carries the log tail."""


class PolicyStack:
    """The processes in front of the simulators for one policy: Envoy, and the picker(s)/listener if any (and
    the run's Valkey for an arm with the shared load view)."""

    def __init__(self, policy: PolicySpec, workdir: Path, fail_open: bool | None = None) -> None:
        self.policy = policy
        self.workdir = workdir
        self.fail_open = fail_open  # None: EnvoyOptions' default (fail closed) or the policy's envoy overrides
        self.envoy: EnvoyProcess | None = None
        self.pickers: list[PickerProcess] = []
        self.listener: ListenerProcess | None = None
        self.valkey_url: str | None = None
        self._resources = contextlib.ExitStack()  # the Valkey server (stopped by its pid)
        self.backends: list[dict[str, Any]] = []
        self.notes: list[str] = []

    @property
    def picker(self) -> PickerProcess | None:
        """The first picker (the one whose Tier 1/4 stats the harness reports); None without a picker."""
        return self.pickers[0] if self.pickers else None

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def picker_name(self, i: int) -> str:
        return f"picker-{i}" if self.policy.pickers > 1 else "picker"

    def start(self, sims: list[SimulatorProcess]) -> None:
        self.backends = [{"name": s.config.name, "address": s.address} for s in sims]
        addresses: tuple[str, ...] = ()
        if self.policy.picker is not None:
            config: dict[str, Any] = {k: v for k, v in self.policy.picker.items()}
            config["pool"] = {**dict(config.get("pool", {})), "backends": list(self.backends)}  # policy keys kept
            if self.policy.listener:  # one listener; each picker is one more consumer of its feed
                config["kv_cache_index"] = self._start_listener(sims, dict(config.get("kv_cache_index", {})))
            if self.policy.shared_load:
                self.valkey_url = self._resources.enter_context(valkey())
                config["shared_load"] = {**dict(config.get("shared_load", {})), "enabled": True}
                rc = dict(config.get("response_cache", {}))
                config["response_cache"] = {**rc, "redis": {**dict(rc.get("redis", {})), "url": self.valkey_url}}
            for i in range(self.policy.pickers):
                name = f"{self.picker_name(i)}-{self.policy.name}"
                self.pickers.append(start_picker(config, self.workdir, name=name))
            addresses = tuple(f"127.0.0.1:{p.extproc_port}" for p in self.pickers)
        overrides: dict[str, Any] = dict(self.policy.envoy) if addresses else {}
        if addresses and self.fail_open is not None:
            overrides["fail_open"] = self.fail_open
        opts = EnvoyOptions(
            listen_port=free_port(),
            listen_address="127.0.0.1",
            admin_port=free_port(),
            picker_address=addresses[0] if addresses else None,
            picker_addresses=addresses if len(addresses) > 1 else (),
            backends=tuple(b["address"] for b in self.backends),
            max_requests=100_000,
            **overrides,
        )
        self.envoy = start_envoy(opts, self.workdir)

    def _start_listener(self, sims: list[SimulatorProcess], kv_index: dict[str, Any]) -> dict[str, Any]:
        """Start ``kv-listener`` over the simulators' ZMQ events; returns the picker's kv_cache_index."""
        sources = sim_listener_sources(sims)
        self.listener = start_listener({"sources": sources}, self.workdir, name=f"listener-{self.policy.name}")
        kv_index["enabled"] = True
        kv_index["event_sources"] = [
            {"backend_name": s.config.name, "endpoint": self.listener.events_url(s.config.name)} for s in sims
        ]
        return kv_index

    def add_backend(self, sim: SimulatorProcess) -> str:
        """Add a replica: rewrite the picker's config file (hot-reloaded), or report what happened."""
        if self.picker is None:
            note = (
                f"{sim.config.name} started but not added to Envoy's static round-robin cluster (adding one "
                "needs an Envoy restart, which would reset every connection); round robin kept the old replicas"
            )
            self.notes.append(note)
            return note
        self.backends.append({"name": sim.config.name, "address": sim.address})
        for picker in self.pickers:
            cfg = dict(picker.config)
            cfg["pool"] = {**dict(cfg.get("pool", {})), "backends": list(self.backends)}
            picker.config = cfg
            tmp = picker.config_path.with_suffix(".tmp")
            tmp.write_text(yaml.safe_dump(cfg))
            os.replace(tmp, picker.config_path)  # the picker polls the file's mtime (1 s) and reloads
        note = f"{sim.config.name} added to the picker's pool via its hot-reloaded config file"
        if self.policy.listener:
            note += " (the listener's sources are not hot-reloaded: no KV events from it)"
        self.notes.append(note)
        return note

    async def requests_ended(self, killed: Mapping[int, Any], timeout_s: float = 30.0) -> None:
        """Wait until every live picker counts no request in flight: a client has its whole answer a moment before
        the picker hears of the end (Envoy closes the ext_proc stream after the response), and on a busy machine
        that moment is long. The stats read after this describe the finished run. Bounded by ``timeout_s``."""
        live = [p for i, p in enumerate(self.pickers) if i not in killed]
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() < deadline:
                try:
                    busy = 0
                    for p in live:
                        async with http.get(f"{p.admin_url}/admin/pool") as resp:
                            doc = await resp.json()
                        busy += sum(int(b.get("in_flight_requests", 0)) for b in doc.get("backends", []))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    return  # the stats say what they can
                if not busy:
                    return
                await asyncio.sleep(0.05)

    async def picker_stats(self, killed: Mapping[int, dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
        """The first live picker's Tier 1 stats, plus its Tier 4 stats under ``kv_index`` when the listener runs;
        the cached-token and sampled-usage counters summed over every picker; and ``per_picker``: each picker's
        decisions and share (``benchmarks.scale_out``). ``killed``: picker index -> its last scrape before the
        kill (a dead picker answers nothing)."""
        if not self.pickers:
            return None
        killed = killed or {}
        live = [(i, p) for i, p in enumerate(self.pickers) if i not in killed]
        if not live:
            return {"error": "no live picker"}
        first = live[0][1]
        paths = ["/admin/prefix-routing/stats", "/admin/pool"] + (
            ["/admin/kv-index/stats"] if self.policy.listener else []
        )
        out: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                for path in paths:
                    async with http.get(f"{first.admin_url}{path}") as resp:
                        data: dict[str, Any] = await resp.json()
                    if path.startswith("/admin/kv-index"):
                        out["kv_index"] = data
                    elif path == "/admin/pool":
                        out["ttft_model"] = data.get("ttft_model")
                    else:
                        out.update(data)
                texts: list[str] = []
                rows: list[dict[str, Any]] = []
                for i, p in enumerate(self.pickers):
                    if i in killed:
                        last = killed[i]
                        rows.append(last or {"name": self.picker_name(i), "killed": True, "decisions": 0.0})
                        continue
                    metrics, pool = await scrape_picker(http, p.admin_url)
                    texts.append(metrics)
                    rows.append(picker_report(self.picker_name(i), metrics, pool))
            merged = merge_metrics(texts) if len(texts) > 1 else texts[0]
            out["sampled_usage"] = sampled_usage(merged)
            out["cached_token_counters"] = picker_cached_token_counters(merged)
            out["per_picker"] = with_shares(rows)
            return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"error": str(exc)}

    def kill_target(self) -> KillTarget:
        """The last picker as the kill test's victim, the others as survivors."""
        assert self.envoy is not None and len(self.pickers) > 1
        i = len(self.pickers) - 1
        victim = self.pickers[i]
        return KillTarget(
            name=self.picker_name(i),
            pid=victim.process.proc.pid,
            admin_url=victim.admin_url,
            host=f"127.0.0.1:{victim.extproc_port}",
            survivors=[(self.picker_name(j), p.admin_url) for j, p in enumerate(self.pickers[:i])],
            envoy_admin_url=f"http://127.0.0.1:{self.envoy.opts.admin_port}",
        )

    async def envoy_stats(self) -> dict[str, float]:
        """Envoy's counters about the picker cluster and the ext_proc filter (retries, connect failures,
        ejections, failed and failed-open streams): the evidence behind the kill test's figures."""
        if self.envoy is None or not self.pickers:
            return {}
        url = f"http://127.0.0.1:{self.envoy.opts.admin_port}/stats?filter=(kv_epp_picker|ext_proc)"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
                http.get(url) as resp,
            ):
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        return {name: value for name, value in parse_envoy_stats(text).items() if value != 0}

    def stop(self) -> None:
        for proc in (self.envoy, *self.pickers, self.listener):
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop()
        with contextlib.suppress(Exception):
            self._resources.close()


@dataclasses.dataclass
class PolicyRun:
    """The raw outcome of one policy's run."""

    results: list[RequestResult]
    before: dict[str, PrefixCacheCounters]
    after: dict[str, PrefixCacheCounters]
    url_names: dict[str, str]
    wall_duration_s: float
    picker_stats: dict[str, Any] | None
    events: list[dict[str, Any]]
    notes: list[str]
    load_samples: list[EngineLoadSample] = dataclasses.field(default_factory=list)
    load_truncated: bool = False
    kill: dict[str, Any] | None = None  # the kill test's raw outcome (benchmarks.scale_out.kill_and_watch)
    envoy_stats: dict[str, float] = dataclasses.field(default_factory=dict)


async def _apply_events(
    scenario: Scenario, sims: list[SimulatorProcess], stack: PolicyStack, log_dir: Path, t0: float
) -> list[dict[str, Any]]:
    """Apply the churn events at their (scaled) times; returns what happened and when (simulated s)."""
    done: list[dict[str, Any]] = []
    for ev in sorted(scenario.events, key=lambda e: e.at_s):
        delay = ev.at_s * scenario.time_scale - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        at = (time.perf_counter() - t0) / scenario.time_scale
        if ev.action == "restart":
            await asyncio.to_thread(sims[ev.replica].restart)
            done.append({"at_s": round(at, 2), "action": "restart", "replica": sims[ev.replica].config.name})
        elif ev.action == "add":
            cfg = dataclasses.replace(scenario.sim, name=f"sim-{ev.replica}", port=0, engine_label=str(ev.replica))
            sim = SimulatorProcess(cfg, None, log_dir / f"sim-{ev.replica}.log")
            await asyncio.to_thread(sim.start)
            sims.append(sim)
            note = stack.add_backend(sim)
            done.append({"at_s": round(at, 2), "action": "add", "replica": cfg.name, "note": note})
    return done


async def run_policy(
    scenario: Scenario,
    policy: PolicySpec,
    workdir: Path,
    poll_s: float = 0.1,
    kill_picker_at_s: float | None = None,
    fail_open: bool | None = None,
) -> PolicyRun:
    """Run ``scenario`` through ``policy`` on fresh (cold) simulators; ``PolicyStartError`` when the
    policy's processes do not start. ``kill_picker_at_s`` (simulated s on the trace's clock, like the churn
    events): with several pickers, SIGKILL the last one then and watch the survivors (``benchmarks.scale_out``)."""
    log_dir = workdir / policy.name
    log_dir.mkdir(parents=True, exist_ok=True)
    sims = await asyncio.to_thread(start_simulators, scenario.replicas, scenario.sim, None, log_dir)
    stack = PolicyStack(policy, log_dir, fail_open)
    try:
        try:
            await asyncio.to_thread(stack.start, sims)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise PolicyStartError(str(exc)) from exc
        urls = [s.base_url for s in sims]
        before = await scrape_prefix_cache_counters(urls)

        def pool() -> dict[str, str]:  # the replicas the policy routes to (round robin never gains sim-4)
            names = {b["name"] for b in stack.backends}
            return {s.config.name: s.base_url for s in sims if s.config.name in names}

        poller = EngineLoadPoller(pool, period_s=poll_s)
        poller.start()
        t0 = time.perf_counter()
        events_task = asyncio.create_task(_apply_events(scenario, sims, stack, log_dir, t0))
        kill_task = None
        trace_done = asyncio.Event()
        if kill_picker_at_s is not None and len(stack.pickers) > 1:
            kill_task = asyncio.create_task(
                kill_and_watch(
                    stack.kill_target(), kill_picker_at_s * scenario.time_scale, t0, scenario.time_scale, trace_done
                )
            )
        try:
            results = await run_trace(
                scenario.records, stack.url, max_concurrency=scenario.max_concurrency, time_scale=scenario.time_scale
            )
        finally:
            trace_done.set()
            samples = await poller.stop()
        wall = max((r.start_s + (r.latency_s or 0.0) for r in results), default=time.perf_counter() - t0)
        if not events_task.done():
            events_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            events = await events_task
        if events_task.cancelled():
            events = []
        kill = await kill_task if kill_task is not None else None  # None: the trace ended before the kill time
        after = await scrape_prefix_cache_counters([s.base_url for s in sims])
        killed = {len(stack.pickers) - 1: (kill or {}).get("last_scrape")} if kill else {}
        await stack.requests_ended(killed)
        stats = await stack.picker_stats(killed)
        url_names = {s.base_url: s.config.name for s in sims}
        return PolicyRun(
            results, before, after, url_names, wall, stats, events, list(stack.notes), samples, poller.truncated,
            kill, await stack.envoy_stats(),
        )  # fmt: skip
    finally:
        await asyncio.to_thread(stack.stop)
        for s in sims:
            with contextlib.suppress(Exception):
                s.stop()


def picker_cached_token_counters(metrics: str) -> dict[str, Any]:
    """The picker's cached-token counters: every ``continuum_*`` sample whose name contains ``cached``
    (issue 12's per-decision available / captured / delivered cached tokens and the stale-index count, with
    whatever labels the picker gives them; none when the picker does not export them). ``series``: each
    sample as exposed (``name{labels}``); ``totals``: summed over labels per name. ``_created`` samples
    (timestamps) are left out."""
    series: dict[str, float] = {}
    totals: dict[str, float] = {}
    for name, labels, value in parse_prometheus_text(metrics):
        if not name.startswith("continuum_") or "cached" not in name or name.endswith("_created"):
            continue
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        series[key] = value
        totals[name] = totals.get(name, 0.0) + value
    return {"series": series, "totals": totals}


def sampled_usage(metrics: str) -> dict[str, Any]:
    """The picker's response sample (``kv_epp_sampled_usage_*``, ``kv_epp_responses_observed_total``) and its
    per-decision cached-token counters (``continuum_picker_cached_tokens_total``, summed over reason):
    prompt and cached tokens of the sampled responses, their cached share, and how many were sampled."""
    values: dict[str, float] = {}
    tokens: dict[tuple[str, str], float] = {}
    for name, labels, value in parse_prometheus_text(metrics):
        if name == "continuum_picker_cached_tokens_total":
            k = (labels.get("scope", ""), labels.get("kind", ""))
            tokens[k] = tokens.get(k, 0.0) + value
        elif name in ("kv_epp_sampled_usage_tokens_total", "kv_epp_responses_observed_total"):
            values[name + ":" + (labels.get("kind") or labels.get("observed") or "")] = value
        elif name == "kv_epp_sampled_usage_responses_total":
            values[name] = value
    prompt = values.get("kv_epp_sampled_usage_tokens_total:prompt", 0.0)
    cached = values.get("kv_epp_sampled_usage_tokens_total:cached", 0.0)
    # difference estimator: Tier 4's predicted (captured) cached share over all decisions, corrected by the
    # observed responses' mean error (delivered − captured) per prompt token; the prediction is known for every
    # request, the delivery only for the observed ones, so only the prediction's error is sampled
    all_pred, all_prompt = tokens.get(("all", "captured"), 0.0), tokens.get(("all", "prompt"), 0.0)
    o_pred, o_prompt = tokens.get(("observed", "captured"), 0.0), tokens.get(("observed", "prompt"), 0.0)
    o_delivered = tokens.get(("observed", "delivered"), 0.0)
    estimate = round(all_pred / all_prompt + (o_delivered - o_pred) / o_prompt, 4) if o_prompt and all_prompt else None
    return {
        "responses_sampled": values.get("kv_epp_responses_observed_total:sampled", 0.0),
        "responses_with_usage": values.get("kv_epp_sampled_usage_responses_total", 0.0),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "predicted": {
            "all_prompt": all_prompt,
            "all_available": tokens.get(("all", "available"), 0.0),
            "all_cached": all_pred,
            "sampled_prompt": o_prompt,
            "sampled_cached": o_pred,
            "sampled_delivered": o_delivered,
        },
        "available_share": round(tokens.get(("all", "available"), 0.0) / all_prompt, 4) if all_prompt else None,
        "captured_share": round(all_pred / all_prompt, 4) if all_prompt else None,
        "calibrated_cached_share": estimate,
    }


def machine_description() -> str:
    try:
        load = os.getloadavg()
        load_s = f", load average at start {load[0]:.2f}"
    except OSError:
        load_s = ""
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs (shared with other work){load_s}, "
        f"Python {platform.python_version()}; the load generator, Envoy, the picker and every simulator "
        "share these cores"
    )


def _sim_params(sim: SimConfig) -> dict[str, Any]:
    keep = (
        "block_size", "capacity_blocks", "max_num_seqs", "max_num_batched_tokens", "step_overhead_ms",
        "prefill_ms_per_token", "decode_ms_per_seq", "time_scale",
    )  # fmt: skip
    return {k: getattr(sim, k) for k in keep}


def _arm(policy: PolicySpec) -> dict[str, Any]:
    """A scale-out arm's keys on a policy that did not run (none for a plain 1-picker policy)."""
    return {"base": policy.base, "pickers": policy.pickers} if policy.base else {}


def run(
    scenario: Scenario,
    policies: list[PolicySpec],
    out: Path,
    plots: bool = True,
    poll_s: float = 0.1,
    kill_picker_at_s: float | None = None,
    fail_open: bool | None = None,
) -> dict[str, Any]:
    """Run every policy on ``scenario``; write and return the results document. ``kill_picker_at_s``: the
    kill test in every arm with several pickers (``run_policy``); ``fail_open``: Envoy's failure mode for the
    picker (None: the policy's own, fail closed unless it says otherwise)."""
    bound = bound_hit_rate(scenario.records, block_size=scenario.sim.block_size)
    span = max((r.t for r in scenario.records), default=0.0)
    window_s = max(1.0, round(span / 20.0, 1))
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "description": scenario.description,
        "params": {
            **scenario.params,
            "replicas": scenario.replicas,
            "requests": len(scenario.records),
            "target_rate": scenario.target_rate,
            "max_concurrency": scenario.max_concurrency,
            "time_scale": scenario.time_scale,
            "seed": scenario.seed,
            "window_s": window_s,
            "policies": [p.name for p in policies],
            "policy_setup": {p.name: p.description for p in policies},
            "envoy_body_mode": "FULL_DUPLEX_STREAMED",
            "pickers": {p.name: p.pickers for p in policies if p.picker is not None},
            "shared_load": {p.name: p.shared_load for p in policies if p.picker is not None},
            "kill_picker_at_s": kill_picker_at_s,
            "envoy_fail_open": fail_open,
            "sim": _sim_params(scenario.sim),
            "bound_detail": dataclasses.asdict(bound),
        },
        "bound_hit_rate": round(bound.hit_rate, 4),
        "calibration": scenario.calibration,
        "machine": machine_description(),
        "notes": [],
        "policies": {},
    }
    workdir = make_workdir(f"kv-epp-routing-{scenario.name}-")
    doc["params"]["workdir"] = str(workdir)
    for policy in policies:
        if not policy.available:
            doc["policies"][policy.name] = {**unavailable(policy.unavailable_reason), **_arm(policy)}
            print(f"[{policy.name}] not available: {policy.unavailable_reason}", flush=True)
            continue
        print(f"[{policy.name}] running {len(scenario.records)} requests ...", flush=True)
        started = time.perf_counter()
        try:
            pr = asyncio.run(run_policy(scenario, policy, workdir, poll_s, kill_picker_at_s, fail_open))
        except PolicyStartError as exc:
            doc["policies"][policy.name] = {**failed_to_start(str(exc)), **_arm(policy)}
            print(f"[{policy.name}] {doc['policies'][policy.name]['reason']}", flush=True)
            continue
        figures = policy_figures(
            pr.results, pr.before, pr.after, pr.url_names,
            bound=bound.hit_rate, target_rate=scenario.target_rate, time_scale=scenario.time_scale,
            wall_duration_s=pr.wall_duration_s, window_s=window_s,
        )  # fmt: skip
        figures["picker_stats"] = pr.picker_stats
        figures["pickers"] = policy.pickers if policy.picker is not None else 0
        figures["shared_load"] = policy.shared_load
        figures["base"] = policy.base
        figures["per_picker"] = (pr.picker_stats or {}).get("per_picker")
        figures["envoy_picker_stats"] = pr.envoy_stats
        if pr.kill is not None:
            figures["kill"] = kill_figures(pr.kill, pr.results, scenario.time_scale)
        elif kill_picker_at_s is not None and policy.pickers > 1:
            figures["notes_kill"] = "no kill: the trace ended before --kill-picker-at"
        sample = (pr.picker_stats or {}).get("sampled_usage") or {}
        if sample.get("responses_sampled"):
            figures["sampled_cached_share"] = sample.get("cached_share")  # vs the engines' hit_rate
            figures["sampled_calibrated_cached_share"] = sample.get("calibrated_cached_share")
        figures["engine_load"] = load_figures(pr.load_samples, poll_s, pr.load_truncated)
        figures["idle_while_queued"] = figures["engine_load"]["idle_while_queued"]
        figures["busy_fraction"] = figures["engine_load"]["busy_fraction"]
        figures["events"] = pr.events
        figures["restart_recovery"] = restart_recovery(figures, window_s)
        figures["notes"] = [*policy.notes, *pr.notes]
        doc["policies"][policy.name] = figures
        doc["notes"] += [f"{policy.name}: {n}" for n in figures["notes"]]
        print(
            f"[{policy.name}] hit {figures['hit_rate']} (bound {bound.hit_rate:.4f}) share {figures['request_share']} "
            f"busy {figures['busy_fraction']} idle while queued {figures['idle_while_queued']}; "
            f"ttft p99 send {figures['ttft_ms']['p99']} / arrival {figures['ttft_from_arrival_ms']['p99']} ms, "
            f"{time.perf_counter() - started:.1f} s wall"
            + (
                f"; sampled cached share {figures['sampled_cached_share']} over "
                f"{sample.get('responses_sampled'):.0f} sampled responses, calibrated "
                f"{figures['sampled_calibrated_cached_share']}"
                if "sampled_cached_share" in figures
                else ""
            ),
            flush=True,
        )
        pp = figures["per_picker"]
        if pp and len(pp["pickers"]) > 1:
            print(
                f"[{policy.name}] decisions per picker: "
                + ", ".join(f"{r['name']} {r['decisions']:.0f} ({r.get('share')})" for r in pp["pickers"]),
                flush=True,
            )
    write_report(doc, out, plots=plots)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.routing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=list(SCENARIOS))
    src.add_argument("--trace", type=Path, help="JSONL trace file (docs/benchmarks.md format)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="real s per simulated s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=2, help="with --trace")
    ap.add_argument("--rate", type=float, default=None, help="target rate with --trace (default: from the trace)")
    ap.add_argument("--max-concurrency", type=int, default=32, help="with --trace")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--poll-ms", type=float, default=100.0, help="period of the engines' queue polls (wall ms)")
    ap.add_argument("--pickers", type=int, default=1, help="picker processes per picker-backed policy (one Envoy)")
    ap.add_argument(
        "--shared-load", choices=("off", "on", "both"), default="off",
        help="the pickers' shared load view (one Valkey for the run): off, on, or both as two arms",
    )  # fmt: skip
    ap.add_argument("--baseline", action="store_true", help="with --pickers N > 1: also run each policy with 1 picker")
    ap.add_argument(
        "--kill-picker-at", type=float, default=None, metavar="S",
        help="simulated seconds on the trace's clock: SIGKILL one of the N pickers then (arms with N > 1)",
    )  # fmt: skip
    ap.add_argument(
        "--fail-open", choices=("on", "off"), default=None,
        help="Envoy's failure_mode_allow for the picker (default: the policy's, fail closed like the chart's default)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        policies = scale_out_arms(parse_policies(a.policies), a.pickers, a.shared_load, a.baseline)
    except ValueError as exc:
        ap.error(str(exc))
    fail_open = {"on": True, "off": False, None: None}[a.fail_open]
    if a.trace is not None:
        scenario = trace_scenario(a.trace, a.replicas, None, a.rate, a.max_concurrency, a.time_scale)
    else:
        scenario = SCENARIOS[a.scenario](a.time_scale, a.seed)
    out = a.out or Path("out") / scenario.name
    doc = run(
        scenario, policies, out, plots=not a.no_plots, poll_s=a.poll_ms / 1000.0,
        kill_picker_at_s=a.kill_picker_at, fail_open=fail_open,
    )  # fmt: skip
    print()
    print(markdown_table(doc))
    print()
    print(ttft_detail_table(doc))
    table = per_picker_table(doc)
    if table:
        print()
        print(table)
    scale = scale_out_lines(doc)
    if scale:
        print("\nScale-out (each arm against the same policy with 1 picker):")
        for line in scale:
            print(f"  {line}")
    kills = kill_lines(doc)
    if kills:
        print("\nKill test:")
        for line in kills:
            print(f"  {line}")
    print()
    print("Checks:")
    for line in comparison_lines(doc):
        print(f"  {line}")
    goals = goal_checks(doc)
    if goals:
        print(f"Issue 12's goals for {scenario.name}:")
        for line in goals:
            print(f"  {line}")
    print(f"\nwrote {out}/results.json, results.md and plots")
    return 0


__all__ = ["DEFAULT_POLICIES", "POLICIES", "ChurnEvent", "PolicyStack", "PolicyStartError", "main", "run", "run_policy"]

if __name__ == "__main__":
    sys.exit(main())
