"""End to end, all real processes: simulated vLLM engines (ZMQ KV events) -> kv-listener -> picker
(Tier 4) -> Envoy. A request goes to the replica holding its prefix; after that replica restarts or
evicts the prefix, the picker stops preferring it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import free_port, make_workdir, start_envoy, start_listener, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import PIN_HEADER, KvStackClient, kv_picker_config, listener_sources, start_sims
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy


def prompt(tag: str, words: int = 320) -> str:
    return " ".join(f"{tag}-w{i}" for i in range(words))


class KvStack(KvStackClient):
    def __init__(self, sims: list[SimulatorProcess], picker: Any, envoy: Any) -> None:
        self.sims, self.picker, self.envoy = sims, picker, envoy


@pytest.fixture(scope="module")
def kv_stack() -> Iterator[KvStack]:
    workdir = make_workdir("kv-epp-e2e-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    try:
        sims = start_sims(workdir, 2, 96)
        listener = start_listener({"sources": listener_sources(sims)}, workdir)
        procs.append(listener)
        picker = start_picker(kv_picker_config(sims, listener.url), workdir)
        procs.append(picker)
        envoy = start_envoy(
            EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                         picker_address=f"127.0.0.1:{picker.extproc_port}", subset_hint_from_header=PIN_HEADER,
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
    holder = s.chat(system, "warm up", pin=1, max_tokens=4)
    assert holder == "sim-1"
    wait_until(lambda: s.entries().get("sim-1", 0) >= 20, timeout=15.0, what="sim-1's blocks in the picker's index")
    before = s.decisions()
    served = [s.chat(system, f"follow-up {i}", max_tokens=4) for i in range(6)]
    assert served == ["sim-1"] * 6  # round robin alone would alternate
    assert s.decisions()["kv_aware"] - before["kv_aware"] == 6

    s.sims[1].restart()  # cache cleared, AllBlocksCleared, sequence reset
    wait_until(
        lambda: s.entries().get("sim-1", 0) == 0, timeout=15.0, what="sim-1's entries to be dropped after its restart"
    )
    before = s.decisions()
    s.chat(system, "after restart", max_tokens=4)
    after = s.decisions()
    assert after["fallback"] - before["fallback"] == 1 and after["kv_aware"] == before["kv_aware"]


def test_picker_stops_preferring_a_replica_that_evicted_the_prefix(kv_stack: KvStack) -> None:
    s = kv_stack
    system = prompt("evict")
    s.chat(system, "warm up", pin=0, max_tokens=4)
    wait_until(lambda: s.entries().get("sim-0", 0) >= 20, timeout=15.0, what="sim-0's blocks in the picker's index")
    assert s.chat(system, "still there", max_tokens=4) == "sim-0"
    created_before = s.admin("/admin/kv-index/backends")
    evicted0 = next(b for b in created_before["backends"] if b["backend_name"] == "sim-0")["events"]["index_evicted"]
    for i in range(5):  # 96-block cache: these 5 prompts of ~21 blocks push the first one out (LRU)
        s.chat(prompt(f"filler{i}"), "x", pin=0, max_tokens=4)

    def evicted() -> bool:
        b = next(b for b in s.admin("/admin/kv-index/backends")["backends"] if b["backend_name"] == "sim-0")
        return bool(b["events"]["index_evicted"] > evicted0)

    wait_until(evicted, timeout=15.0, what="BlockRemoved events to reach the index")
    before = s.decisions()
    s.chat(system, "after eviction", max_tokens=4)
    after = s.decisions()
    assert after["kv_aware"] == before["kv_aware"]  # nobody holds the evicted prefix's first block any more
    assert after["fallback"] - before["fallback"] == 1


def test_kv_index_admin_endpoints(kv_stack: KvStack) -> None:
    kv_stack.chat(prompt("ttft-model"), "x", max_tokens=4)  # a tokenized request's first byte teaches the TTFT model
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
    model = kv_stack.admin("/admin/pool")["ttft_model"]
    assert model["samples"] > 0 and model["prefill_ms_per_token"] > 0 and model["mean_prefill_tokens"] > 0
    assert 'continuum_picker_ttft_model{coefficient="samples"}' in metrics
