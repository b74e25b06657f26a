"""Every request of a session lands in one arm: across two pickers (each behind its own real Envoy, over the same
echo backends) and across a restart of one of them, for sessions named by a header and for sessions known only
by their first turn. Read from the pickers' decision logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http, start_backends
from tests.support.ready_process import poll

ARMS = {"a": {"selection_strategy": "RoundRobin"}, "b": {"selection_strategy": "LeastRequest"}}


def picker_config(backends: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    return {
        "pool": {"backends": backends},
        "experiments": {"enabled": True, "salt": "it-1", "decision_log": str(log), "arms": ARMS},
    }


def envoy_for(picker: PickerProcess, backends: list[dict[str, Any]], workdir: Path) -> EnvoyProcess:
    opts = EnvoyOptions(
        listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
        picker_address=f"127.0.0.1:{picker.extproc_port}", picker_tls=picker.tls, response_mode="full",
        backends=tuple(b["address"] for b in backends),
    )  # fmt: skip
    return start_envoy(opts, workdir)


def traffic(url: str) -> None:
    for i in range(24):  # sessions named by the header
        r = http("POST", url + "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "q"}]},
                 {"x-session-id": f"session-{i}"})  # fmt: skip
        assert r.status == 200, r.body
    for i in range(8):  # no header: the first turn is the session (a later turn repeats it)
        messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"first question {i}"}]
        for turn in range(2):
            body = {"model": "m", "messages": messages + [{"role": "user", "content": f"more {turn}"}] * turn}
            assert http("POST", url + "/v1/chat/completions", body).status == 200


def read(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_a_session_keeps_its_arm_across_two_pickers_and_a_restart(tmp_path: Path) -> None:
    backends = start_backends(2, tmp_path)
    pool = backends.pool()
    logs = [tmp_path / "p0.jsonl", tmp_path / "p1.jsonl", tmp_path / "p0-restarted.jsonl"]
    pickers: list[PickerProcess] = []
    envoys: list[EnvoyProcess] = []
    try:
        for i in range(2):
            pickers.append(start_picker(picker_config(pool, logs[i]), tmp_path, name=f"exp-{i}"))
            envoys.append(envoy_for(pickers[i], pool, tmp_path))
        traffic(envoys[0].url)
        traffic(envoys[1].url)
        # restart picker 0 on its ports (its Envoy reconnects), writing to a new log
        cfg = dict(pickers[0].config)
        pickers[0].stop()
        cfg["experiments"] = {**cfg["experiments"], "decision_log": str(logs[2])}
        pickers[0] = start_picker(cfg, tmp_path, name="exp-0-restarted")
        # Envoy takes the picker's cluster back once it connects again: a GET (no body, its own session: source
        # "none") until one passes
        poll(lambda: http("GET", envoys[0].url + "/v1/models").status == 200, "Envoy to reach the restarted picker")
        traffic(envoys[0].url)
    finally:
        for e in envoys:
            e.stop()
        for p in pickers:
            p.stop()  # SIGTERM: the decision log's queue is written at stop
        backends.process.stop()
    records = [r for log in logs for r in read(log) if r["session_source"] != "none"]
    assert [sum(r["session_source"] != "none" for r in read(log)) for log in logs] == [40, 40, 40]
    arm_of: dict[str, set[str]] = {}
    for r in records:
        arm_of.setdefault(r["session"], set()).add(r["arm"])
        assert r["strategy"] == ARMS[r["arm"]]["selection_strategy"]
        assert r["status"] == 200 and r["endpoint"] in {"be-0", "be-1"} and r["complete"] is True
    assert len(arm_of) == 32  # 24 by header, 8 by first turn
    assert all(len(arms) == 1 for arms in arm_of.values()), {s: a for s, a in arm_of.items() if len(a) > 1}
    assert {next(iter(a)) for a in arm_of.values()} == {"a", "b"}
    by_source = {r["session_source"] for r in records}
    assert by_source == {"header", "first_turn"}
    restarted = read(logs[2])
    assert {r["turn"] for r in restarted if r["session_source"] == "header"} == {1}  # a new process: turns anew
