"""End to end, all real processes: simulated vLLM engines (ZMQ KV events) -> kv-listener -> picker
(Tier 4) -> Envoy. A request goes to the replica holding its prefix; after that replica restarts or
evicts the prefix, the picker stops preferring it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import KvEventsSettings
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import free_port, make_workdir, start_envoy, start_listener, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy
PIN = "x-test-subset"
MODEL = "sim-model"


def prompt(tag: str, words: int = 320) -> str:
    return " ".join(f"{tag}-w{i}" for i in range(words))


class KvStack:
    def __init__(self, sims: list[SimulatorProcess], picker: Any, envoy: Any) -> None:
        self.sims, self.picker, self.envoy = sims, picker, envoy

    def chat(self, system: str, user: str, pin: int | None = None) -> tuple[int, str]:
        headers = {PIN: self.sims[pin].address} if pin is not None else None
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        r = http("POST", self.envoy.url + "/v1/chat/completions", body, headers)
        assert r.status == 200, r.body
        return r.status, r.headers["x-kv-sim-name"]

    def admin(self, path: str) -> Any:
        return http("GET", self.picker.admin_url + path).json()

    def entries(self) -> dict[str, int]:
        return {b["backend_name"]: b["entries"] for b in self.admin("/admin/kv-index/backends")["backends"]}

    def decisions(self) -> dict[str, int]:
        return self.admin("/admin/kv-index/stats")["routing_decisions"]


@pytest.fixture(scope="module")
def kv_stack() -> Iterator[KvStack]:
    workdir = make_workdir("kv-epp-e2e-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    try:
        for i in range(2):
            sim = SimulatorProcess(
                SimConfig(name=f"sim-{i}", model=MODEL, capacity_blocks=96, time_scale=0.02),
                KvEventsSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", encoding="map"),
                log_path=workdir / f"sim-{i}.log",
            )
            sim.start()
            sims.append(sim)
        listener = start_listener(
            {
                "sources": [
                    {"backend_name": s.config.name, "engine": "vllm", "model": MODEL, "block_size": 16,
                     "zmq_endpoint": s.kv_events_endpoint, "replay_endpoint": s.replay_endpoint}
                    for s in sims
                ]
            },
            workdir,
        )  # fmt: skip
        procs.append(listener)
        picker = start_picker(
            {
                "selection_strategy": "RoundRobin",
                "prefix_routing": {"enabled": True},
                "kv_cache_index": {
                    "enabled": True,
                    "entry_ttl_seconds": 3600,
                    "event_sources": [
                        {"backend_name": s.config.name, "endpoint": listener.events_url(s.config.name)} for s in sims
                    ],
                    "tokenizer": {"source": "engine", "timeout_ms": 3000, "block_size": 16},
                },
                "pool": {"backends": [{"name": s.config.name, "address": s.address} for s in sims]},
            },
            workdir,
        )
        procs.append(picker)
        envoy = start_envoy(
            EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                         picker_address=f"127.0.0.1:{picker.extproc_port}", subset_hint_from_header=PIN,
                         backends=tuple(s.address for s in sims)),
            workdir,
        )  # fmt: skip
        procs.append(envoy)
        stack = KvStack(sims, picker, envoy)
        wait_until(
            lambda: all(b["connection"]["connected"] for b in stack.admin("/admin/kv-index/backends")["backends"]),
            timeout=15.0,
            what="feed consumers to connect",
        )
        yield stack
    finally:
        for p in reversed(procs):
            p.stop()
        for s in sims:
            s.stop()


def test_request_follows_the_replica_that_holds_its_prefix_until_it_restarts(kv_stack: KvStack) -> None:
    s = kv_stack
    system = prompt("restart")
    _, holder = s.chat(system, "warm up", pin=1)
    assert holder == "sim-1"
    wait_until(lambda: s.entries().get("sim-1", 0) >= 20, timeout=15.0, what="sim-1's blocks in the picker's index")
    before = s.decisions()
    served = [s.chat(system, f"follow-up {i}")[1] for i in range(6)]
    assert served == ["sim-1"] * 6  # round robin alone would alternate
    assert s.decisions()["kv_aware"] - before["kv_aware"] == 6

    s.sims[1].restart()  # cache cleared, AllBlocksCleared, sequence reset
    wait_until(
        lambda: s.entries().get("sim-1", 0) == 0, timeout=15.0, what="sim-1's entries to be dropped after its restart"
    )
    before = s.decisions()
    s.chat(system, "after restart")
    after = s.decisions()
    assert after["fallback"] - before["fallback"] == 1 and after["kv_aware"] == before["kv_aware"]


def test_picker_stops_preferring_a_replica_that_evicted_the_prefix(kv_stack: KvStack) -> None:
    s = kv_stack
    system = prompt("evict")
    s.chat(system, "warm up", pin=0)
    wait_until(lambda: s.entries().get("sim-0", 0) >= 20, timeout=15.0, what="sim-0's blocks in the picker's index")
    assert s.chat(system, "still there")[1] == "sim-0"
    created_before = s.admin("/admin/kv-index/backends")
    evicted0 = next(b for b in created_before["backends"] if b["backend_name"] == "sim-0")["events"]["index_evicted"]
    for i in range(5):  # 96-block cache: these 5 prompts of ~21 blocks push the first one out (LRU)
        s.chat(prompt(f"filler{i}"), "x", pin=0)

    def evicted() -> bool:
        b = next(b for b in s.admin("/admin/kv-index/backends")["backends"] if b["backend_name"] == "sim-0")
        return bool(b["events"]["index_evicted"] > evicted0)

    wait_until(evicted, timeout=15.0, what="BlockRemoved events to reach the index")
    before = s.decisions()
    s.chat(system, "after eviction")
    after = s.decisions()
    assert after["kv_aware"] == before["kv_aware"]  # nobody holds the evicted prefix's first block any more
    assert after["fallback"] - before["fallback"] == 1


def test_kv_index_admin_endpoints(kv_stack: KvStack) -> None:
    stats = kv_stack.admin("/admin/kv-index/stats")
    assert stats["enabled"] is True and stats["config"]["event_sources_count"] == 2
    assert {e["backend_name"] for e in stats["event_sources"]} == {"sim-0", "sim-1"}
    assert (
        stats["routing_decisions"]["total"]
        == stats["routing_decisions"]["kv_aware"] + stats["routing_decisions"]["fallback"]
    )
    metrics = http("GET", kv_stack.picker.admin_url + "/metrics").body.decode()
    assert "continuum_kv_index_routing_decisions_total" in metrics
    assert 'continuum_kv_consumer_connected{backend="sim-0"} 1.0' in metrics
