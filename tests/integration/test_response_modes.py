"""Response modes through the real Envoy and simulated engines that stream SSE.

- The default (``none``): no response body message reaches the picker, yet every response's status is
  observed and the in-flight slot is held until the request ends — completed or aborted by the client
  mid-stream — and then released (Envoy closes the ext_proc stream when the HTTP stream ends).
- ``sampled`` (BUFFERED bodies): a request carrying the opt-in header streams its response body through the
  picker; the client gets the whole body and the picker counts the usage it carried.
- ``full``: every chunk passes through the picker; accounting stays exact as well.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http as http_get
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

MODEL = "sim-model"
SAMPLE_HEADER = "x-kv-epp-sample"
LONG_STREAM_TOKENS = 20_000  # a stream that outlives the test's checks (it is aborted)


@dataclass
class ModeStack:
    sims: list[SimulatorProcess]
    picker: PickerProcess
    envoy: EnvoyProcess
    body_mode: str
    response_mode: str

    @property
    def port(self) -> int:
        return self.envoy.opts.listen_port

    def admin(self, path: str) -> Any:
        return http_get("GET", self.picker.admin_url + path).json()

    def in_flight(self) -> int:
        return sum(b["in_flight_requests"] for b in self.admin("/admin/prefix-routing/stats")["backend_distribution"])

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the picker's /metrics (0 when absent)."""
        text = http_get("GET", self.picker.admin_url + "/metrics").body.decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
        m = re.search("^" + pattern + "$", text, re.M)
        return float(m.group(1)) if m else 0.0


def body(user: str, max_tokens: int, stream: bool) -> bytes:
    req: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        req["stream_options"] = {"include_usage": True}
    return json.dumps(req).encode()


def post(port: int, payload: bytes, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", payload, {"content-type": "application/json", **(headers or {})})
    return conn.getresponse()


def build(workdir: Path, body_mode: str, response_mode: str) -> Iterator[ModeStack]:
    sims: list[SimulatorProcess] = []
    picker = envoy = None
    try:
        for i in range(2):
            sim = SimulatorProcess(
                SimConfig(name=f"sim-{i}", model=MODEL, kv_events_enabled=False),
                log_path=workdir / f"sim-{body_mode}-{response_mode}-{i}.log",
            )
            sims.append(sim)
            sim.start()
        pool = [{"name": s.config.name, "address": s.address} for s in sims]
        cfg = {
            "selection_strategy": "PrefixAwareHash",  # a repeated prompt goes back to the engine that cached it
            "prefix_routing": {"enabled": True},
            "pool": {"backends": pool},
            "extproc": {"response_sample_rate": 0.0},  # only the opt-in header samples: deterministic
        }
        picker = start_picker(cfg, workdir, name=f"picker-{body_mode}-{response_mode}")
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
            picker_address=f"127.0.0.1:{picker.extproc_port}", body_mode=body_mode,  # type: ignore[arg-type]
            response_mode=response_mode,  # type: ignore[arg-type]
            backends=tuple(p["address"] for p in pool),
        )  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield ModeStack(sims, picker, envoy, body_mode, response_mode)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for s in sims:
            s.stop()


@pytest.fixture(
    scope="module",
    params=[("FULL_DUPLEX_STREAMED", "none"), ("BUFFERED", "sampled"), ("FULL_DUPLEX_STREAMED", "full")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[ModeStack]:
    yield from build(workdir, *request.param)


def test_in_flight_held_to_the_end_and_released_after_aborts(stack: ModeStack) -> None:
    """Streams that are open hold their slot past the first byte; after client aborts mid-stream and
    completed streams, every in-flight counter is back to 0."""
    assert stack.in_flight() == 0
    open_streams = []
    for i in range(6):
        r = post(stack.port, body(f"long stream {i}", LONG_STREAM_TOKENS, stream=True))
        assert r.status == 200
        assert r.read1(65536).startswith(b"data: ")  # the stream has started: first bytes delivered
        open_streams.append(r)
    wait_until(lambda: stack.in_flight() == len(open_streams), what="one in-flight slot per open stream")

    def complete(i: int) -> bytes:
        r = post(stack.port, body(f"short stream {i}", 32, stream=True))
        data = r.read()
        r.close()
        return data

    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(complete, range(16)))
        for r in open_streams:  # the client goes away mid-stream
            r.close()
    assert all(d.rstrip().endswith(b"data: [DONE]") for d in done)
    wait_until(lambda: stack.in_flight() == 0, what="every in-flight slot released")
    assert all(b["in_flight_requests"] == 0 for b in stack.admin("/admin/pool")["backends"])


def test_status_observed_without_the_body(stack: ModeStack) -> None:
    """Every routed response is observed at its headers (status, first byte), sampled or not."""
    before = stack.metric("kv_epp_responses_observed_total", observed="headers")
    served_before = sum(b["successes"] for b in stack.admin("/admin/pool")["backends"])
    for i in range(5):
        r = post(stack.port, body(f"status {i}", 4, stream=False))
        assert r.status == 200
        assert json.loads(r.read())["usage"]["prompt_tokens"] > 0
    wait_until(
        lambda: stack.metric("kv_epp_responses_observed_total", observed="headers") >= before + 5,
        what="5 more responses observed at their headers",
    )
    assert sum(b["successes"] for b in stack.admin("/admin/pool")["backends"]) >= served_before + 5
    assert all(b["latency_ewma_ms"] is not None for b in stack.admin("/admin/pool")["backends"])


def test_opted_in_request_is_sampled_with_usage(stack: ModeStack) -> None:
    """The opt-in header streams the body through the picker where the mode allows it (sampled); the client
    always gets the whole stream, usage chunk included."""
    seen = stack.metric("kv_epp_sampled_usage_responses_total")
    cached = stack.metric("kv_epp_sampled_usage_tokens_total", kind="cached")
    prompt = stack.metric("kv_epp_sampled_usage_tokens_total", kind="prompt")
    user = "a sampled request " + "with a long enough prompt to span a few cache blocks " * 4
    usages = []
    for _ in range(2):  # the second one hits the engine's prefix cache
        r = post(stack.port, body(user, 8, stream=True), {SAMPLE_HEADER: "1"})
        assert r.status == 200
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        usages.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    if stack.response_mode != "sampled":
        assert stack.metric("kv_epp_responses_observed_total", observed="sampled") == 0
        return
    wait_until(lambda: stack.metric("kv_epp_sampled_usage_responses_total") == seen + 2, what="2 usages read")
    assert stack.metric("kv_epp_sampled_usage_tokens_total", kind="prompt") == prompt + sum(u[0] for u in usages)
    assert stack.metric("kv_epp_sampled_usage_tokens_total", kind="cached") == cached + sum(u[1] for u in usages)
    assert usages[1][1] > 0  # the delivered cached tokens of the repeat are measured
    assert stack.metric("kv_epp_response_sample_rate") == 0.0  # the configured fraction is exported
