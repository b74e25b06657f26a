"""Several pickers behind one Envoy in the routing harness (issue 28): the arms, each picker's decisions, and
the kill-one-picker test (docs/benchmarks.md, "Several pickers").

- ``scale_out_arms``: from the policies asked for, the arms to run: a picker-backed policy with ``--pickers N``
  (N > 1) becomes ``<policy>@N`` (shared view off) and/or ``<policy>@N+shared`` (shared view on: one Valkey for
  the run, ``shared_load.enabled`` in every picker), plus the 1-picker policy itself with ``--baseline``.
- ``picker_report``: one picker's decisions (``continuum_picker_decisions_total``, by backend), requests by
  outcome and its ``/admin/pool`` ``shared_load`` object (absent in a picker without the shared view).
- ``PickerKiller``: at a simulated time, SIGKILL one picker (by pid), then every 100 ms (wall) poll the
  survivors' ``/admin/pool`` ``shared_load.peers`` and Envoy's view of the dead host, until the survivors no
  longer count it and Envoy has taken it out (or the bound on polls).
- ``kill_figures``: the failed requests (status, error, and whether Envoy could have retried them, from when
  they were sent) and the two recovery times.

Bounds: the poll loop stops after ``MAX_KILL_POLLS`` polls (60 s at 100 ms); every list here is bounded by the
trace (one entry per request at most) or by the number of pickers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from benchmarks.loadgen import RequestResult, parse_prometheus_text
from benchmarks.policies import PolicySpec

SHARED_SUFFIX = "+shared"
KILL_POLL_S = 0.1  # wall seconds between two polls of the survivors' view after the kill
MAX_KILL_POLLS = 600  # at most 60 s of polls
VIEW_RECOVERY_GOAL_S = 5.0  # issue 28: the survivors stop counting the dead picker within 5 s


def scale_out_arms(
    policies: Sequence[PolicySpec], pickers: int, shared_load: str = "off", baseline: bool = False
) -> list[PolicySpec]:
    """The arms to run. ``shared_load``: off | on | both. A policy without a picker (round robin) runs once as
    it is; so does every policy when ``pickers`` is 1 and the shared view is off."""
    if pickers < 1:
        raise ValueError("--pickers must be at least 1")
    if shared_load not in ("off", "on", "both"):
        raise ValueError("--shared-load is off, on or both")
    out: list[PolicySpec] = []
    for p in policies:
        if p.picker is None:
            out.append(p)
            continue
        suffix = f"@{pickers}" if pickers > 1 else ""
        if baseline and pickers > 1:
            out.append(p)
        if shared_load in ("off", "both"):
            out.append(dataclasses.replace(p, name=p.name + suffix, pickers=pickers, base=p.name) if suffix else p)
        if shared_load in ("on", "both"):
            out.append(
                dataclasses.replace(
                    p,
                    name=p.name + suffix + SHARED_SUFFIX,
                    pickers=pickers,
                    shared_load=True,
                    base=p.name,
                    description=f"{p.description}; {pickers} picker(s) sharing their load view through one Valkey",
                )
            )
    return out


# -- one picker's figures -----------------------------------------------------------------------------------
def picker_counts(metrics: str) -> dict[str, Any]:
    """A picker's decision counters from its /metrics: decisions by backend (summed over strategy), requests by
    outcome, and the shared view's gauges when it exports them."""
    by_backend: dict[str, float] = {}
    outcomes: dict[str, float] = {}
    shared: dict[str, float] = {}
    for name, labels, value in parse_prometheus_text(metrics):
        if name == "continuum_picker_decisions_total":
            b = labels.get("backend", "")
            by_backend[b] = by_backend.get(b, 0.0) + value
        elif name == "continuum_picker_requests_total":
            o = labels.get("outcome", "")
            outcomes[o] = outcomes.get(o, 0.0) + value
        elif name.startswith("continuum_picker_shared_load_") and not name.endswith("_created"):
            key = name.removeprefix("continuum_picker_shared_load_")
            shared[key] = shared.get(key, 0.0) + value
    return {
        "decisions": sum(by_backend.values()),
        "decisions_by_backend": dict(sorted(by_backend.items())),
        "requests_by_outcome": dict(sorted(outcomes.items())),
        "shared_load_metrics": shared or None,
    }


def merge_metrics(texts: Sequence[str]) -> str:
    """Several pickers' /metrics as one exposition: each (name, labels) sample summed over the pickers (counters
    add up; the harness reads only counters from the merged text)."""
    summed: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for name, labels, value in parse_prometheus_text(text):
            key = (name, tuple(sorted(labels.items())))
            summed[key] = summed.get(key, 0.0) + value
    lines = []
    for (name, label_items), value in summed.items():
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in label_items) + "}" if label_items else ""
        lines.append(f"{name}{lab} {value!r}")
    return "\n".join(lines) + "\n"


async def scrape_picker(http: aiohttp.ClientSession, admin_url: str) -> tuple[str, dict[str, Any] | None]:
    """One picker's /metrics text and /admin/pool document (raises on a connection error)."""
    async with http.get(f"{admin_url}/metrics") as resp:
        metrics = await resp.text()
    async with http.get(f"{admin_url}/admin/pool") as resp:
        pool: dict[str, Any] | None = await resp.json() if resp.status == 200 else None
    return metrics, pool


def picker_report(name: str, metrics: str, pool: Mapping[str, Any] | None, killed: bool = False) -> dict[str, Any]:
    """One picker's row: its counters and its ``shared_load`` object (None when it reports none)."""
    shared = pool.get("shared_load") if isinstance(pool, Mapping) else None
    return {"name": name, "killed": killed, **picker_counts(metrics), "shared_load": shared}


def with_shares(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each picker's share of the decisions, and the totals."""
    total = sum(r["decisions"] for r in rows)
    for r in rows:
        r["share"] = round(r["decisions"] / total, 4) if total else None
    return {"pickers": rows, "decisions_total": total, "pickers_with_decisions": sum(1 for r in rows if r["decisions"])}


# -- the kill test --------------------------------------------------------------------------------------------
def _peer_ids(shared: Any) -> set[str] | None:
    if not isinstance(shared, Mapping):
        return None
    peers = shared.get("peers")  # picker id → its age and load (picker/pool/shared_load.py, ``status``)
    return {str(k) for k in peers} if isinstance(peers, Mapping) else None


def _envoy_host_state(clusters_json: Mapping[str, Any], host: str) -> dict[str, Any] | None:
    """The picker host's health flags in Envoy's /clusters?format=json (None when not listed)."""
    for c in clusters_json.get("cluster_statuses", []):
        if c.get("name") != "kv_epp_picker":
            continue
        for h in c.get("host_statuses", []):
            sa = (h.get("address") or {}).get("socket_address") or {}
            if f"{sa.get('address')}:{sa.get('port_value')}" == host:
                return dict(h.get("health_status") or {})
    return None


def _envoy_excluded(state: Mapping[str, Any] | None) -> bool:
    """Envoy no longer sends new streams to the host: failed health check or outlier ejection."""
    if state is None:
        return True
    flags = ("failed_active_health_check", "failed_outlier_check", "pending_dynamic_removal")
    return any(state.get(f) for f in flags) or state.get("eds_health_status") == "UNHEALTHY"


@dataclasses.dataclass
class KillTarget:
    """What the killer needs of the stack: the victim (pid, its admin URL, its ext_proc host as Envoy lists it),
    the survivors' admin URLs and Envoy's admin URL."""

    name: str
    pid: int
    admin_url: str
    host: str
    survivors: list[tuple[str, str]]  # (name, admin URL)
    envoy_admin_url: str


async def kill_and_watch(
    target: KillTarget, at_wall_s: float, t0: float, time_scale: float, trace_done: asyncio.Event
) -> dict[str, Any] | None:
    """Wait until ``at_wall_s`` after ``t0`` (perf_counter), scrape the victim one last time, SIGKILL it, then
    poll (every ``KILL_POLL_S``) the survivors' shared view and Envoy's view of the victim until both have let
    it go or the polls run out. Times in the result are wall seconds from the kill (and the kill's time on
    the trace in simulated seconds). None, and no kill, when ``trace_done`` is set before the kill time."""
    delay = at_wall_s - (time.perf_counter() - t0)
    if delay > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(trace_done.wait(), timeout=delay)
            return None
    elif trace_done.is_set():
        return None
    out: dict[str, Any] = {"picker": target.name, "host": target.host, "signal": "SIGKILL"}
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            metrics, pool = await scrape_picker(http, target.admin_url)
            out["last_scrape"] = picker_report(target.name, metrics, pool, killed=True)
        except (aiohttp.ClientError, TimeoutError) as exc:
            out["last_scrape"] = None
            out["last_scrape_error"] = str(exc)
        victim_id = None
        if out.get("last_scrape") and isinstance(out["last_scrape"].get("shared_load"), Mapping):
            victim_id = out["last_scrape"]["shared_load"].get("picker_id")
        out["picker_id"] = victim_id
        killed = time.perf_counter()  # just before the signal: a request sent after this counts as after the kill
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.pid, signal.SIGKILL)
        out["at_s"] = round((killed - t0) / time_scale, 2)
        out["at_wall_s"] = round(killed - t0, 3)
        view_s: float | None = None
        envoy_s: float | None = None
        reported = False
        polls: list[dict[str, Any]] = []
        for _ in range(MAX_KILL_POLLS):
            await asyncio.sleep(KILL_POLL_S)
            now = time.perf_counter() - killed
            sample: dict[str, Any] = {"t_s": round(now, 3), "survivors": {}}
            counted_by = []
            for name, url in target.survivors:
                try:
                    async with http.get(f"{url}/admin/pool") as resp:
                        doc = await resp.json() if resp.status == 200 else None
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    doc = None
                ids = _peer_ids(doc.get("shared_load") if isinstance(doc, Mapping) else None)
                if ids is not None:
                    reported = True
                    sample["survivors"][name] = sorted(ids)
                    if victim_id is not None and victim_id in ids:
                        counted_by.append(name)
            if view_s is None and reported and victim_id is not None and not counted_by:
                view_s = round(now, 3)
            if envoy_s is None:
                try:
                    async with http.get(f"{target.envoy_admin_url}/clusters?format=json") as resp:
                        state = _envoy_host_state(await resp.json(content_type=None), target.host)
                    sample["envoy"] = state
                    if _envoy_excluded(state):
                        envoy_s = round(now, 3)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
            if len(polls) < 100:  # the first 10 s of polls kept as evidence
                polls.append(sample)
            view_done = view_s is not None or not reported or victim_id is None
            if view_done and envoy_s is not None and now >= 1.0:
                break
    out["shared_view_reported"] = reported and victim_id is not None
    out["view_recovered_s"] = view_s
    out["envoy_excluded_s"] = envoy_s
    out["polls"] = polls
    return out


def kill_figures(kill: dict[str, Any], results: Sequence[RequestResult], time_scale: float) -> dict[str, Any]:
    """The failed requests around the kill and whether Envoy could have retried each: a request sent after
    the kill opened a new ext_proc stream, whose open Envoy retries on another picker (a refused connection or
    a reset before any answer); a request in flight at the kill whose stream was on the dead picker had its
    answer already (Envoy retries nothing then). Which picker held a stream is not visible to the client, so
    the class comes from the timing."""
    at = kill["at_wall_s"]
    failed = []
    for r in results:
        if r.ok:
            continue
        end = r.start_s + (r.latency_s or 0.0)
        if r.start_s >= at:
            when, retryable = "sent after the kill", True
        elif r.latency_s is None or end >= at:
            when, retryable = "in flight at the kill", False
        else:
            when, retryable = "before the kill", None
        failed.append(
            {
                "index": r.index,
                "status": r.status,
                "error": (r.error or "")[:300],
                "sent_s": round(r.start_s / time_scale, 3),
                "when": when,
                "envoy_could_retry": retryable,
            }
        )
    in_flight = sum(1 for r in results if r.start_s < at and (r.latency_s is None or r.start_s + r.latency_s >= at))
    lost_retryable = sum(1 for f in failed if f["envoy_could_retry"])
    view = kill.get("view_recovered_s")
    return {
        **{k: v for k, v in kill.items() if k != "polls"},
        "polls": kill.get("polls", []),
        "requests_in_flight_at_kill": in_flight,
        "failed": failed,
        "failed_total": len(failed),
        "failed_retryable": lost_retryable,
        "goal_no_retryable_lost": lost_retryable == 0,
        "goal_view_within_5s": None
        if view is None and not kill.get("shared_view_reported")
        else (view is not None and view <= VIEW_RECOVERY_GOAL_S),
    }


# -- tables ---------------------------------------------------------------------------------------------------
def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def per_picker_table(doc: Mapping[str, Any]) -> str:
    """One row per policy run by a picker: the decisions in total and each picker's count and share."""
    lines = ["| policy | pickers | decisions | per picker: decisions (share) |", "|---|---|---|---|"]
    rows = 0
    for name, p in doc["policies"].items():
        pp = p.get("per_picker") if p.get("available") else None
        if not pp:
            continue
        cells = ", ".join(
            f"{r['name']}{' (killed)' if r.get('killed') else ''}: {r['decisions']:.0f} ({_share(r.get('share'))})"
            for r in pp["pickers"]
        )
        lines.append(f"| {name} | {len(pp['pickers'])} | {pp['decisions_total']:.0f} | {cells} |")
        rows += 1
    return "\n".join(lines) if rows else ""


def _share(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.2f}x" if x is not None and base else "—"


def scale_out_lines(doc: Mapping[str, Any]) -> list[str]:
    """Per arm with several pickers (or the shared view): share of the bound and TTFT p99 from send and from
    arrival, each against the 1-picker run of the same policy when it ran in this invocation."""
    pols = doc["policies"]
    out: list[str] = []
    for name, p in pols.items():
        base_name = p.get("base")
        if not base_name:
            continue
        if not p.get("available"):
            out.append(f"{name}: {p.get('reason', 'not available')}")
            continue
        base = pols.get(base_name) if pols.get(base_name, {}).get("available") else None
        send, arrival = p["ttft_ms"]["p99"], p["ttft_from_arrival_ms"]["p99"]
        vb = p.get("hit_rate_vs_bound")
        line = (
            f"{name} ({p.get('pickers', 1)} pickers): {_num(None if vb is None else 100 * vb, '{:.2f}')}% of bound; "
            f"TTFT p99 send {_num(send)} ms, arrival {_num(arrival)} ms"
        )
        if base is not None:
            bvb = base.get("hit_rate_vs_bound")
            line += (
                f"; vs {base_name} (1 picker): bound share {_num(None if bvb is None else 100 * bvb, '{:.2f}')}%, "
                f"TTFT p99 send {_ratio(send, base['ttft_ms']['p99'])}, "
                f"arrival {_ratio(arrival, base['ttft_from_arrival_ms']['p99'])}"
            )
        else:
            line += f"; {base_name} (1 picker) not in this run (--baseline runs it)"
        out.append(line)
    return out


def kill_lines(doc: Mapping[str, Any]) -> list[str]:
    """Per policy with a kill: the failed requests and the two recovery times, with issue 28's goals."""
    out: list[str] = []
    for name, p in doc["policies"].items():
        k = p.get("kill") if p.get("available") else None
        if not k:
            continue
        statuses: dict[str, int] = {}
        for f in k["failed"]:
            key = f"{f['status']} ({f['when']})"
            statuses[key] = statuses.get(key, 0) + 1
        view = (
            f"{k['view_recovered_s']} s"
            if k.get("view_recovered_s") is not None
            else ("not within the polls" if k.get("shared_view_reported") else "not reported (no shared view)")
        )
        out.append(
            f"{name}: killed {k['picker']} (SIGKILL) at {k['at_s']} s simulated ({k['at_wall_s']} s wall); "
            f"{k['requests_in_flight_at_kill']} requests in flight; failed {k['failed_total']} "
            f"{json_compact(statuses)}; Envoy stopped sending it new streams after "
            f"{_num(k.get('envoy_excluded_s'), '{:.2f}')} s; survivors' view dropped it after {view}"
        )
        out.append(
            f"  [{'met' if k['goal_no_retryable_lost'] else 'NOT MET'}] no request Envoy could retry was lost "
            f"({k['failed_retryable']} lost)"
        )
        g = k.get("goal_view_within_5s")
        out.append(
            f"  [{'no figure' if g is None else 'met' if g else 'NOT MET'}] survivors' view recovered within "
            f"{VIEW_RECOVERY_GOAL_S:.0f} s: {view}"
        )
    return out


def json_compact(d: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}" if d else "{}"
