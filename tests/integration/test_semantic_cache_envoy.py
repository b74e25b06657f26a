"""The semantic cache through the real Envoy (full duplex and BUFFERED request bodies, response mode full) with
the engine simulator as a child process serving both the chat completions and ``POST /v1/embeddings``: after a
stored answer, a near-duplicate question (one word changed) is ``X-Cache: HIT`` with ``X-Cache-Mode: semantic`` and
the engine is not reached; the same near-duplicate with another system prompt, or with a tool list, is a MISS
that reaches the engine; so is Bob's near-duplicate of Alice's question (another ``Authorization``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_sim import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import HttpResult, http

pytestmark = pytest.mark.envoy

MODEL = "sim-model"
QUESTION = (
    "How do I configure the maximum number of cached entries for the response cache in the picker "
    "when running on Kubernetes with three replicas?"
)
NEAR = QUESTION.replace("three", "four")
TOOLS = [{"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}}]
DEADLINE_S = 60.0


class Stack:
    def __init__(self, sim: SimulatorProcess, picker: PickerProcess, envoy: EnvoyProcess) -> None:
        self.sim, self.picker, self.envoy = sim, picker, envoy

    def engine_requests(self) -> float:
        """Requests the engine finished (the simulator's own counter; embeddings are not generations)."""
        text = http("GET", self.sim.base_url + "/metrics").body.decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
        )

    def ask(self, question: str, system: str, caller: str = "sk-alice", **fields: Any) -> HttpResult:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": messages, **fields}
        r = http("POST", self.envoy.url + "/v1/chat/completions", body, {"authorization": f"Bearer {caller}"})
        assert r.status == 200, (r.status, r.body[:300])
        return r

    def store(self, question: str, system: str) -> None:
        """Ask until the exact entry answers (the semantic entry is written and indexed before the exact one):
        the answer is stored and its vector indexed. Polls with a generous deadline, no timing assumed."""
        first = self.ask(question, system)
        assert first.headers.get("x-cache") == "MISS" and "x-cache-mode" not in first.headers, first.headers
        end = time.monotonic() + DEADLINE_S
        while self.ask(question, system).headers.get("x-cache") != "HIT":
            assert time.monotonic() < end, "the answer was never stored"
            time.sleep(0.05)


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp(f"semantic-{request.param}")
    sim = SimulatorProcess(
        SimConfig(name="sim-0", model=MODEL, time_scale=0.001, kv_events_enabled=False), log_path=workdir / "sim.log"
    )
    picker = envoy = None
    try:
        sim.start()
        cfg = {
            "selection_strategy": "RoundRobin",
            "pool": {"backends": [{"name": "sim-0", "address": sim.address}]},
            "response_cache": {
                "enabled": True,
                "semantic": {"enabled": True, "backend": sim.base_url, "embedding_model": MODEL},  # threshold 0.92
            },
            "extproc": {"response_sample_rate": 0.0},
        }
        picker = start_picker(cfg, workdir, name="picker-semantic")
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), response_mode="full",
            body_mode=request.param, backends=(sim.address,), **picker.envoy_picker_options(),
        )  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield Stack(sim, picker, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        sim.stop()
    assert sim.pid is None


def system_prompt() -> str:
    return f"You answer questions about kv-epp (session {uuid.uuid4().hex})."  # a partition of this test's own


def test_near_duplicate_is_a_semantic_hit_without_the_engine(stack: Stack) -> None:
    system = system_prompt()
    stack.store(QUESTION, system)
    stored = stack.ask(QUESTION, system)
    engine = stack.engine_requests()
    near = stack.ask(NEAR, system)
    assert near.headers.get("x-cache") == "HIT" and near.headers.get("x-cache-mode") == "semantic", near.headers
    assert near.body == stored.body  # the stored answer to the similar question
    assert stack.engine_requests() == engine  # the engine was not reached
    metrics = http("GET", stack.picker.admin_url + "/metrics").body.decode()
    assert 'continuum_response_cache_semantic_requests_total{result="hit"}' in metrics


@pytest.mark.parametrize(
    "change",
    [pytest.param({"system": "You are a pirate."}, id="system-prompt"), pytest.param({"tools": TOOLS}, id="tools")],
)
def test_other_system_prompt_or_tool_list_misses(stack: Stack, change: dict[str, Any]) -> None:
    system = system_prompt()
    stack.store(QUESTION, system)
    engine = stack.engine_requests()
    other_system = change.get("system")
    fields = {k: v for k, v in change.items() if k != "system"}
    miss = stack.ask(NEAR, other_system + system if other_system else system, **fields)
    assert miss.headers.get("x-cache") == "MISS" and "x-cache-mode" not in miss.headers, miss.headers
    assert stack.engine_requests() == engine + 1  # it reached the engine


def test_another_caller_never_gets_the_answer(stack: Stack) -> None:
    system = system_prompt()
    stack.store(QUESTION, system)  # as Alice
    alice = stack.ask(NEAR, system)
    assert alice.headers.get("x-cache") == "HIT" and alice.headers.get("x-cache-mode") == "semantic", alice.headers
    engine = stack.engine_requests()
    # Bob's near-duplicate (another word changed: the exact cache, keyed without the caller, has no entry for it)
    bob = stack.ask(QUESTION.replace("three", "five"), system, caller="sk-bob")
    assert bob.headers.get("x-cache") == "MISS" and "x-cache-mode" not in bob.headers, bob.headers
    assert stack.engine_requests() == engine + 1  # it reached the engine
