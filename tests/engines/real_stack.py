"""The real-engine tests' client for one stack: real vLLM engines, kv-listener, the picker (and a reference
listener + picker that never restart), Envoy. Requests go through Envoy, streamed with usage, as clients send
them; answers are read as vLLM sends them (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import json
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.loadgen import parse_prometheus_text
from benchmarks.stack import ListenerProcess, start_listener
from benchmarks.vllm_engine.process import MODEL_NAME, VllmProcess
from tests.integration.conftest import http
from tests.support.kv_stack import KvStackClient

PIN_HEADER = "x-test-subset"  # Envoy's subset hint from a header: pins a request to one engine's address


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int | None  # None: the engine did not say (unknown, not zero)
    chunks: int  # content chunks streamed


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int = 4, headers: dict[str, str] | None = None,
                timeout: float = 300.0, response_headers: dict[str, str] | None = None) -> Usage:  # fmt: skip
    """One streamed chat completion with ``stream_options.include_usage``; the usage of its last chunk.
    ``response_headers``, when given, is filled with the answer's headers (names lower-cased)."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
    )
    usage: dict[str, Any] | None = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        if response_headers is not None:
            response_headers.update({k.lower(): v for k, v in r.headers.items()})
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                chunks += 1
    assert usage is not None, "a streamed answer with include_usage ends with a usage chunk"
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage["prompt_tokens"]), details.get("cached_tokens"), chunks)


class RealStack(KvStackClient):
    """``KvStackClient``'s admin views (backends, entries, decisions) over real engines; ``chat`` streams."""

    def __init__(self, engines: list[VllmProcess], workdir: Path, listener_cfg: dict[str, Any]) -> None:
        self.engines = engines
        self.workdir = workdir
        self.listener_cfg = listener_cfg
        self.listener: ListenerProcess | None = None
        self.picker: Any = None
        self.ref_picker: Any = None
        self.envoy: Any = None
        self.restarts = 0
        self.last_seen: dict[str, Any] = {}

    # -- processes ---------------------------------------------------------------------------------
    def start_listener(self) -> None:
        self.listener = start_listener(self.listener_cfg, self.workdir, name=f"listener-{self.restarts}")
        self.restarts += 1

    def kill_listener(self) -> None:
        assert self.listener is not None
        self.listener.process.stop(sig=signal.SIGKILL)

    def engine(self, name: str) -> VllmProcess:
        return next(e for e in self.engines if e.config.name == name)

    # -- requests ------------------------------------------------------------------------------------
    def chat(self, messages: list[dict[str, str]], pin: str | None = None, max_tokens: int = 4) -> Usage:
        headers = {PIN_HEADER: self.engine(pin).address} if pin is not None else None
        return stream_chat(self.envoy.url, messages, max_tokens, headers)

    def tokenize(self, engine: str, messages: list[dict[str, str]]) -> list[int]:
        body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
        r = http("POST", self.engine(engine).base_url + "/tokenize", body, timeout=60)
        assert r.status == 200, r.body
        return [int(t) for t in r.json()["tokens"]]

    # -- the picker's view ---------------------------------------------------------------------------
    def self_checks(self) -> dict[str, str]:
        return {b: v["self_check"] for b, v in self.admin("/readyz")["kv_feeds"].items()}

    def cached_token_counters(self) -> dict[tuple[str, str], float]:
        """The picker's per-decision cached-token counters: (scope, kind) → tokens, summed over reasons."""
        out: dict[tuple[str, str], float] = {}
        metrics = http("GET", self.picker.admin_url + "/metrics").body.decode()
        for name, labels, value in parse_prometheus_text(metrics):
            if name == "continuum_picker_cached_tokens_total":
                k = (labels.get("scope", ""), labels.get("kind", ""))
                out[k] = out.get(k, 0.0) + value
        return out

    def index_is_truth(self) -> bool:
        """Both pickers connected, and every backend's (key, tier) pairs equal the reference picker's."""
        mine, ref = self.backends(), self.backends(self.ref_picker)
        self.last_seen = {n: (mine[n]["entries"], ref[n]["entries"], mine[n]["connection"]["connected"]) for n in ref}
        if not all(b["connection"]["connected"] for b in [*mine.values(), *ref.values()]):
            return False
        return all(mine[n]["entries_digest"] == ref[n]["entries_digest"] for n in ref)
