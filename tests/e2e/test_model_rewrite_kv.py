"""Model rewrites end to end, all real processes: simulated vLLM engines serving two LoRA adapters (ZMQ KV events,
keyed with the adapter) -> kv-listener -> picker (Tier 4) -> Envoy. The engines answer 404 to a model they do not
serve (``adapter`` is no adapter of theirs), so a 200 shows the rewritten model reached the engine. An alias
``adapter`` -> ``adapter-v2``: the prompt's blocks, cached by the engine under adapter-v2, bring the follow-ups back
to that engine (Tier 4 keys the rewritten requests with adapter-v2); the same prompt sent as ``adapter-v1`` finds no
blocks. A 90/10 canary then reaches the engines as both adapters (the engines answer with their base model's name:
which adapter each request was, the picker's decisions counter says)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import free_port, make_workdir, start_envoy, start_listener, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import MODEL, PIN_HEADER, KvStackClient, kv_picker_config, listener_sources, start_sims
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

ALIAS = {"name": "alias", "rules": [{"matches": [{"model": {"value": "adapter"}}], "targets": [
    {"modelRewrite": "adapter-v2"}]}]}  # fmt: skip
CANARY = {"name": "canary", "rules": [{"matches": [{"model": {"value": "adapter"}}], "targets": [
    {"modelRewrite": "adapter-v1", "weight": 90}, {"modelRewrite": "adapter-v2", "weight": 10}]}]}  # fmt: skip


class Stack(KvStackClient):
    def __init__(self, sims: list[SimulatorProcess], picker: Any, envoy: Any) -> None:
        self.sims, self.picker, self.envoy = sims, picker, envoy

    def ask(self, model: str, system: str, user: str, pin: int | None = None) -> tuple[int, str | None]:
        """One chat completion for ``model`` through Envoy: (status, the engine that answered)."""
        headers = {PIN_HEADER: self.sims[pin].address} if pin is not None else None
        body = {"model": model, "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}  # fmt: skip
        r = http("POST", self.envoy.url + "/v1/chat/completions", body, headers)
        return r.status, r.headers.get("x-kv-sim-name")

    def set_rewrites(self, rewrites: list[dict[str, Any]]) -> None:
        cfg = yaml.safe_load(self.picker.config_path.read_text())
        cfg["model_rewrites"] = rewrites
        self.picker.config_path.write_text(yaml.safe_dump(cfg))
        r = http("POST", self.picker.admin_url + "/admin/config/reload", {})
        assert r.status == 200, r.body


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    workdir = make_workdir("kv-epp-rewrite-e2e-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    try:
        sims = start_sims(workdir, 2, 256, lora_adapters="adapter-v1,adapter-v2")
        listener = start_listener({"sources": listener_sources(sims)}, workdir)
        procs.append(listener)
        cfg = kv_picker_config(sims, listener.url, lora_adapters={"adapter-v1": MODEL, "adapter-v2": MODEL})
        picker = start_picker({**cfg, "model_rewrites": [ALIAS]}, workdir)
        procs.append(picker)
        envoy = start_envoy(
            EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                         picker_address=f"127.0.0.1:{picker.extproc_port}", subset_hint_from_header=PIN_HEADER,
                         backends=tuple(s.address for s in sims)),
            workdir,
        )  # fmt: skip
        procs.append(envoy)
        stack = Stack(sims, picker, envoy)
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


def test_tier4_keys_a_rewritten_request_with_the_served_adapter(stack: Stack) -> None:
    s = stack
    s.set_rewrites([ALIAS])
    system = " ".join(f"alias-w{i}" for i in range(320))
    assert s.ask("adapter", system, "warm up", pin=1) == (200, "sim-1")  # "adapter" would be a 404
    wait_until(lambda: s.entries().get("sim-1", 0) >= 20, timeout=15.0, what="sim-1's blocks in the picker's index")
    before = s.decisions()
    served = [s.ask("adapter", system, f"follow-up {i}") for i in range(6)]
    assert served == [(200, "sim-1")] * 6  # round robin alone would alternate
    assert s.decisions()["kv_aware"] - before["kv_aware"] == 6
    before = s.decisions()
    status, _ = s.ask("adapter-v1", system, "another adapter")  # not rewritten: its own blocks, none cached
    after = s.decisions()
    assert status == 200
    assert after["kv_aware"] == before["kv_aware"] and after["fallback"] - before["fallback"] == 1


def test_a_canary_reaches_the_engines_as_both_adapters_and_no_rule_is_a_404(stack: Stack) -> None:
    s = stack
    s.set_rewrites([CANARY])
    for i in range(100):
        assert s.ask("adapter", f"canary {i}", "q")[0] == 200  # every one reached an engine as a served adapter
    metrics = http("GET", s.picker.admin_url + "/metrics").body.decode()
    series = (
        r'^llm_d_epp_model_rewrite_decisions_total\{model_name="adapter",model_rewrite_name="canary",'
        r'target_model="([^"]+)"\} (\S+)$'
    )
    decided = Counter({m: float(v) for m, v in re.findall(series, metrics, re.M)})
    assert set(decided) == {"adapter-v1", "adapter-v2"} and decided.total() == 100
    assert decided["adapter-v1"] > decided["adapter-v2"]  # 90/10 of 100
    s.set_rewrites([])
    assert s.ask("adapter", "no rule", "q")[0] == 404  # the engine's answer to a model it does not serve
