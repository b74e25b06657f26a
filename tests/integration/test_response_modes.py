"""Response modes through the real Envoy and simulated engines that stream SSE.

- The default (``none``): no response body message reaches the picker, yet every response's status is
  observed and the in-flight slot is held until the request ends — completed or aborted by the client
  mid-stream — and then released (Envoy closes the ext_proc stream when the HTTP stream ends).
- ``sampled`` (BUFFERED bodies): a request carrying the opt-in header streams its response body through the
  picker; the client gets the whole body and the picker counts the usage it carried.
- ``full``: every chunk passes through the picker; accounting stays exact as well, and every response's usage
  is read.
- Cached-token accounting (sampled and full, with Tier 4 over a listener fed by the engines' KV events): the
  picker's delivered tokens equal the usage the client got, available and captured are booked per decision,
  and an engine that loses its cache without telling (its clear event dropped) makes the next predicted hit
  a delivered miss: the stale-index counter.
"""

from __future__ import annotations

import http.client
import json
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    PickerProcess,
    free_port,
    start_envoy,
    start_listener,
    start_picker,
)
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
    listener: ListenerProcess | None = None  # Tier 4 runs (KV events → listener → the picker's index)

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
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts label names
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
    """Two simulators, the picker and Envoy; where the picker reads response bodies (sampled, full), also the
    listener and Tier 4 (the overlap scorer: a repeated prompt goes to its holder, as the hash sends it)."""
    sims: list[SimulatorProcess] = []
    picker = envoy = listener = None
    tier4 = response_mode != "none"
    try:
        for i in range(2):
            sim = SimulatorProcess(
                SimConfig(name=f"sim-{i}", model=MODEL, kv_events_enabled=tier4),
                log_path=workdir / f"sim-{body_mode}-{response_mode}-{i}.log",
            )
            sims.append(sim)
            sim.start()
        pool = [{"name": s.config.name, "address": s.address} for s in sims]
        cfg: dict[str, Any] = {
            "selection_strategy": "PrefixAwareHash",  # a repeated prompt goes back to the engine that cached it
            "prefix_routing": {"enabled": True},
            "pool": {"backends": pool},
            "extproc": {"response_sample_rate": 0.0},  # only the opt-in header samples: deterministic
        }
        if tier4:
            sources = [
                {
                    "backend_name": s.config.name, "engine": "vllm", "model": MODEL, "block_size": s.config.block_size,
                    "zmq_endpoint": s.kv_events_endpoint, "replay_endpoint": s.replay_endpoint,
                }
                for s in sims
            ]  # fmt: skip
            listener = start_listener({"sources": sources}, workdir, name=f"listener-{body_mode}-{response_mode}")
            cfg["kv_cache_index"] = {
                "enabled": True,
                "scoring": {"mode": "overlap"},
                "tokenizer": {"timeout_ms": 10_000, "timeout_max_ms": 10_000},  # a slow /tokenize keeps Tier 4
                "event_sources": [
                    {"backend_name": s.config.name, "endpoint": listener.events_url(s.config.name)} for s in sims
                ],
            }
        picker = start_picker(cfg, workdir, name=f"picker-{body_mode}-{response_mode}")
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
            picker_address=f"127.0.0.1:{picker.extproc_port}", body_mode=body_mode,  # type: ignore[arg-type]
            response_mode=response_mode,  # type: ignore[arg-type]
            backends=tuple(p["address"] for p in pool),
        )  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield ModeStack(sims, picker, envoy, body_mode, response_mode, listener)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        if listener is not None:
            listener.stop()
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


def observed(stack: ModeStack) -> float:
    return sum(stack.metric("kv_epp_responses_observed_total", observed=o) for o in ("headers", "sampled"))


def test_status_observed_without_the_body(stack: ModeStack) -> None:
    """Every routed response is observed at its headers (status, first byte), sampled or not."""
    before = observed(stack)
    served_before = sum(b["successes"] for b in stack.admin("/admin/pool")["backends"])
    for i in range(5):
        r = post(stack.port, body(f"status {i}", 4, stream=False))
        assert r.status == 200
        assert json.loads(r.read())["usage"]["prompt_tokens"] > 0
    wait_until(lambda: observed(stack) >= before + 5, what="5 more responses observed at their headers")
    assert sum(b["successes"] for b in stack.admin("/admin/pool")["backends"]) >= served_before + 5
    assert all(b["latency_ewma_ms"] is not None for b in stack.admin("/admin/pool")["backends"])


def test_opted_in_request_is_sampled_with_usage(stack: ModeStack) -> None:
    """The opt-in header streams the body through the picker where the mode allows it (sampled; in full mode
    every body passes through and is read); the client always gets the whole stream, usage chunk included."""
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
    if stack.response_mode == "none":
        assert stack.metric("kv_epp_responses_observed_total", observed="sampled") == 0
        return
    wait_until(lambda: stack.metric("kv_epp_sampled_usage_responses_total") == seen + 2, what="2 usages read")
    assert stack.metric("kv_epp_sampled_usage_tokens_total", kind="prompt") == prompt + sum(u[0] for u in usages)
    assert stack.metric("kv_epp_sampled_usage_tokens_total", kind="cached") == cached + sum(u[1] for u in usages)
    assert usages[1][1] > 0  # the delivered cached tokens of the repeat are measured
    assert stack.metric("kv_epp_response_sample_rate") == 0.0  # the configured fraction is exported


def send_sampled(stack: ModeStack, user: str) -> tuple[str, int, int]:
    """One opted-in streamed request: (the engine that served it, usage prompt_tokens, usage cached_tokens)."""
    r = post(stack.port, body(user, 4, stream=True), {SAMPLE_HEADER: "1"})
    assert r.status == 200
    name = r.getheader("x-kv-sim-name")
    events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    usage = json.loads(events[-2])["usage"]
    assert name is not None
    return name, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_delivered_and_a_stale_index(stack: ModeStack) -> None:
    """Through Envoy with Tier 4: the picker's delivered tokens are the client's usage; a repeat on the holder
    is a hit (captured = available, the only holder); after the engine restarts with its clear event dropped,
    the index still names it, the pick goes there, nothing is delivered: the stale-index counter counts it."""
    if stack.listener is None:
        pytest.skip("no response body is read in this mode")
    user = f"stale index probe {uuid.uuid4().hex} " + "filler words that span several cache blocks " * 12

    def tokens(scope: str, kind: str) -> float:
        return stack.metric("continuum_picker_cached_tokens_total", reason="kv_aware", scope=scope, kind=kind)

    def outcome(o: str) -> float:
        return stack.metric("continuum_picker_observed_predictions_total", reason="kv_aware", outcome=o)

    def snapshot() -> dict[str, float]:
        kinds = [("all", k) for k in ("prompt", "available", "captured")]
        kinds += [("observed", k) for k in ("prompt", "available", "captured", "delivered")]
        out = {f"{scope}:{kind}": tokens(scope, kind) for scope, kind in kinds}
        out |= {o: outcome(o) for o in ("hit", "stale", "unpredicted", "miss")}
        out["usages"] = stack.metric("kv_epp_sampled_usage_responses_total")
        return out

    def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: after[k] - before[k] for k in after if after[k] != before[k]}

    holder, _, _ = send_sampled(stack, user)
    sim = next(s for s in stack.sims if s.config.name == holder)

    def index_caught_up() -> bool:  # the picker's index holds what the engine holds (the prompt's blocks too)
        backends = stack.admin("/admin/kv-index/backends")["backends"]
        entries = next(b["entries"] for b in backends if b["backend_name"] == holder)
        cached_blocks = http_get("GET", sim.base_url + "/sim/state").json()["cached_blocks"]
        return bool(entries == cached_blocks > 0)

    wait_until(index_caught_up, what=f"the picker's index to hold what {holder} holds")
    before = snapshot()
    name, prompt, cached = send_sampled(stack, user)  # the holder again, now chosen by Tier 4
    assert name == holder and cached > 0
    wait_until(lambda: stack.metric("kv_epp_sampled_usage_responses_total") == before["usages"] + 1, what="usage")
    hit = delta(snapshot(), before)
    captured = hit["all:captured"]
    assert captured >= sim.config.block_size and hit["all:available"] == captured  # the only holder
    assert hit == {
        "all:prompt": prompt, "all:available": captured, "all:captured": captured,
        "observed:prompt": prompt, "observed:available": captured, "observed:captured": captured,
        "observed:delivered": cached, "hit": 1, "usages": 1,
    }  # fmt: skip

    # the engine loses its cache without telling: the AllBlocksCleared of its restart is never published, nor any
    # batch after it (this is the module's last use of the stack): a later batch (seq back to 1) would let the
    # listener detect the restart and clear the index before the request is decided (seen in loaded CI runs:
    # the index was then right, not stale, and the decision a fallback)
    sim.set_faults(drop_event_batches=1_000_000)
    sim.restart()
    before = snapshot()
    name, prompt, cached = send_sampled(stack, user)
    assert name == holder and cached == 0  # the stale index still sent it to the (now empty) holder
    wait_until(lambda: stack.metric("kv_epp_sampled_usage_responses_total") == before["usages"] + 1, what="usage")
    stale = delta(snapshot(), before)

    def why() -> str:  # what Tier 4 and the decisions said, should this fail (seen once in CI, not reproduced)
        text = http_get("GET", stack.picker.admin_url + "/metrics").body.decode()
        keep = ("continuum_kv_tokenize", "continuum_kv_index_routing", "continuum_picker_requests", "kv_epp_kv")
        return "\n".join(line for line in text.splitlines() if line.startswith(keep))

    assert stale == {
        "all:prompt": prompt, "all:available": captured, "all:captured": captured,
        "observed:prompt": prompt, "observed:available": captured, "observed:captured": captured,
        "stale": 1, "usages": 1,
    }, why()  # fmt: skip
