"""Every valid request form of issue 9 item 7, through the real Envoy in both body modes, is routed by the
picker and answered 200 by a (simulated) vLLM engine.

Stack: two simulators (``kv-sim`` subprocesses, ports reported on their ready lines) <- Envoy <- the picker
(RoundRobin). Forms: a token-id prompt, a batch of strings, a batch of token-id lists (also streamed),
``max_tokens: 4.0``, a CORS preflight ``OPTIONS`` on the chat path, a Responses API request. Each answer
must come from an engine (``x-kv-sim-name``), not from Envoy or the picker. Refusals that belong to the
engine (a Responses ``prompt`` template, ``max_tokens: 4.5``) are checked to be JSON errors. No timing
assertion: the processes report ready or are polled with deadlines; each is stopped by its pid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.engine_sim.tokenizer import chat_token_ids, encode
from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import HttpResult, http

pytestmark = pytest.mark.envoy

MODEL = "sim-model"
SIM_NAMES = {"sim-0", "sim-1"}


@dataclass
class FormsStack:
    sims: list[SimulatorProcess]
    picker: PickerProcess
    envoy: EnvoyProcess

    def routed(self) -> float:
        """The picker's count of requests it routed (``continuum_picker_requests_total{outcome="routed"}``)."""
        text = http("GET", self.picker.admin_url + "/metrics").body.decode()
        for line in text.splitlines():
            if line.startswith('continuum_picker_requests_total{outcome="routed"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def send(
        self, method: str, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> HttpResult:
        """One request through Envoy, which the picker must have routed (its routed count moves by one)."""
        before = self.routed()
        r = http(method, self.envoy.url + path, body, headers, timeout=60.0)
        assert self.routed() == before + 1, f"{method} {path}: not routed by the picker ({r.status} {r.body[:300]!r})"
        return r

    def post(self, path: str, body: dict[str, Any]) -> HttpResult:
        return self.send("POST", path, body)


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[FormsStack]:
    mode = request.param
    sims: list[SimulatorProcess] = []
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        for name in sorted(SIM_NAMES):
            sim = SimulatorProcess(
                SimConfig(name=name, model=MODEL, time_scale=0.001, kv_events_enabled=False),
                log_path=workdir / f"forms-{mode}-{name}.log",
            )
            sims.append(sim)
            sim.start(timeout_s=60.0)
        pool = [{"name": s.config.name, "address": s.address} for s in sims]
        picker = start_picker(
            {"selection_strategy": "RoundRobin", "pool": {"backends": pool}}, workdir, name=f"picker-forms-{mode}"
        )
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
            picker_address=f"127.0.0.1:{picker.extproc_port}", body_mode=mode,
            backends=tuple(s.address for s in sims),
        )  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield FormsStack(sims, picker, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for sim in sims:
            sim.stop()


def from_engine(r: HttpResult) -> None:
    """The answer was made by a simulator (not by Envoy or the picker)."""
    assert r.headers.get("x-kv-sim-name") in SIM_NAMES, (r.status, r.headers, r.body[:500])


def completion_ok(r: HttpResult, n_choices: int) -> dict[str, Any]:
    assert r.status == 200, (r.status, r.body[:500])
    from_engine(r)
    data: dict[str, Any] = r.json()
    assert data["object"] == "text_completion"
    assert [c["index"] for c in data["choices"]] == list(range(n_choices))
    assert all(isinstance(c["text"], str) and c["text"] for c in data["choices"])
    return data


def test_token_id_prompt(stack: FormsStack) -> None:
    ids = [300 + i for i in range(40)]
    data = completion_ok(stack.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 3}), 1)
    assert data["usage"]["prompt_tokens"] == 40 and data["usage"]["completion_tokens"] == 3


def test_batch_of_strings(stack: FormsStack) -> None:
    batch = ["the first prompt", "a second prompt here"]
    data = completion_ok(stack.post("/v1/completions", {"model": MODEL, "prompt": batch, "max_tokens": 2}), 2)
    assert data["usage"]["prompt_tokens"] == sum(len(encode(p)) for p in batch)
    assert data["usage"]["completion_tokens"] == 4


def test_batch_of_token_lists(stack: FormsStack) -> None:
    batch = [[400, 401, 402], [500, 501], [600]]
    data = completion_ok(stack.post("/v1/completions", {"model": MODEL, "prompt": batch, "max_tokens": 2}), 3)
    assert data["usage"]["prompt_tokens"] == 6 and data["usage"]["completion_tokens"] == 6


def test_streamed_batch_of_token_lists(stack: FormsStack) -> None:
    body = {
        "model": MODEL,
        "prompt": [[700, 701, 702], [800]],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = stack.post("/v1/completions", body)
    assert r.status == 200, (r.status, r.body[:500])
    from_engine(r)
    events = [e.removeprefix("data: ") for e in r.body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    indexes = {c["index"] for chunk in chunks for c in chunk["choices"]}
    assert indexes == {0, 1}
    assert chunks[-1]["usage"]["prompt_tokens"] == 4 and chunks[-1]["usage"]["completion_tokens"] == 6


def test_integral_float_max_tokens(stack: FormsStack) -> None:
    data = completion_ok(stack.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4.0}), 1)
    assert data["usage"]["completion_tokens"] == 4
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4.0}
    r = stack.post("/v1/chat/completions", chat)
    assert r.status == 200, (r.status, r.body[:500])
    from_engine(r)
    assert r.json()["usage"]["completion_tokens"] == 4


def test_fractional_max_tokens_is_a_json_error(stack: FormsStack) -> None:
    r = http("POST", stack.envoy.url + "/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4.5})
    assert r.status == 400, (r.status, r.body[:500])
    assert r.json()  # JSON from whichever layer refused it (vLLM refuses 4.5)


def test_cors_preflight_on_the_chat_path(stack: FormsStack) -> None:
    headers = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    r = stack.send("OPTIONS", "/v1/chat/completions", None, headers)
    assert r.status == 200, (r.status, r.headers, r.body[:500])
    from_engine(r)
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"].split(", ")
    assert r.headers["access-control-allow-headers"] == "content-type"
    assert r.headers["access-control-max-age"] == "600"
    # the actual request that follows the preflight carries the allow-origin header too
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = stack.send("POST", "/v1/chat/completions", body, {"Origin": "https://app.example"})
    assert r.status == 200 and r.headers["access-control-allow-origin"] == "*"
    from_engine(r)


def test_responses_api(stack: FormsStack) -> None:
    body = {
        "model": MODEL,
        "instructions": "answer briefly",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is a prefix cache"}]}],
        "max_output_tokens": 3,
    }
    r = stack.post("/v1/responses", body)
    assert r.status == 200, (r.status, r.body[:500])
    from_engine(r)
    data = r.json()
    assert data["object"] == "response" and data["status"] == "completed"
    assert data["output"][0]["content"][0]["type"] == "output_text"
    expected = chat_token_ids(
        [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is a prefix cache"}]
    )
    assert data["usage"]["input_tokens"] == len(expected) and data["usage"]["output_tokens"] == 3
    # a prompt template: routed by the picker, refused by the engine as vLLM refuses it
    r = stack.post("/v1/responses", {"model": MODEL, "prompt": {"id": "pmpt_1"}, "input": "hello"})
    assert r.status == 400, (r.status, r.body[:500])
    from_engine(r)
    assert r.json()["message"] == "prompt template is not supported"
