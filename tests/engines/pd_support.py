"""What the P/D tests of the real-engine tier share: prompts of a known size, timed requests straight to an engine,
its own counters, and a tap on its KV events (a ZMQ subscriber of our own, decoding every field vLLM sends)."""

from __future__ import annotations

import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq as _zmq

from benchmarks.loadgen import parse_prometheus_text
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    ManagedProcess,
    PickerProcess,
    free_port,
    spawn_ready_line,
    start_envoy,
    start_listener,
    start_picker,
)
from benchmarks.vllm_engine.process import MODEL_NAME, VllmProcess
from picker.api import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import kv_picker_config, listener_sources
from tests.support.poll import wait_until

Z: Any = _zmq  # pyzmq is typed Any (see listener.zmq_receiver)


def document(tag: str, lines: int) -> str:
    """A deterministic Python-like document (the tiny model's tokenizer was trained on such text): about 21 tokens
    a line."""
    rnd = random.Random(tag)
    words = ["value", "result", "index", "buffer", "request", "handler", "config", "stream", "token", "cache"]
    return "\n".join(
        f"def {tag}_{i}({rnd.choice(words)}, {rnd.choice(words)}={i}):\n    return {rnd.choice(words)}[{i}]"
        for i in range(lines)
    )


def messages(tag: str, lines: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": document(tag, lines)}, {"role": "user", "content": f"what is {tag} 7?"}]


def prompt_tokens(engine: VllmProcess, msgs: list[dict[str, str]]) -> int:
    """The prompt's length as the engine counts it (its chat template and generation prompt applied)."""
    r = http(
        "POST", engine.base_url + "/tokenize", {"model": MODEL_NAME, "messages": msgs, "add_generation_prompt": True}
    )
    assert r.status == 200, r.body
    return len(r.json()["tokens"])


def loadable(engine: VllmProcess, tag: str, lines: int, page: int) -> tuple[list[dict[str, str]], int]:
    """A long prompt (``messages(tag, lines)``) and its length, made one token longer when its length is one more
    than a whole number of pages: ExampleConnector stores such a prompt under one name and looks it up under
    another, so the consumer never finds it (docs/pd.md, "On real vLLM"; pinned by its own test)."""
    msgs = messages(tag, lines)
    n = prompt_tokens(engine, msgs)
    while n % page == 1:
        msgs[-1] = {"role": "user", "content": msgs[-1]["content"] + " ok"}
        n = prompt_tokens(engine, msgs)
    return msgs, n


@dataclass
class Answer:
    seconds: float
    usage: dict[str, Any]

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage["prompt_tokens"])

    @property
    def cached_tokens(self) -> int | None:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def timed_chat(url: str, msgs: list[dict[str, str]], max_tokens: int, headers: dict[str, str] | None = None) -> Answer:
    """One non-streamed chat completion (greedy), timed from send to the whole answer."""
    body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = http("POST", url + "/v1/chat/completions", body, headers, timeout=300)
    seconds = time.perf_counter() - t0
    assert r.status == 200, r.body
    return Answer(seconds, r.json()["usage"])


def engine_counter(engine: VllmProcess, name: str) -> float:
    """A vLLM counter from the engine's own ``/metrics``, summed over its series."""
    return metric(http("GET", engine.base_url + "/metrics", timeout=30).body.decode(), name, {})


@dataclass
class Event:
    tag: str
    fields: dict[str, Any]  # the map form's fields, or the array form's known positions by name


# vLLM's array form (before its map form): the tag, then these fields in order (docs/wire.md §3)
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
}


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        return Event(str(raw.get("type")), {k: v for k, v in raw.items() if k != "type"})
    tag = str(raw[0])
    return Event(tag, dict(zip(_ARRAY_FIELDS.get(tag, ()), raw[1:], strict=False)))


@dataclass
class EventTap:
    """Every KV event one engine publishes while the tap is open, decoded with all its fields."""

    endpoint: str
    events: list[Event] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> EventTap:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        time.sleep(0.5)  # ZMQ's slow joiner: a SUB misses what is published before its subscription reaches the PUB
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self, ready: threading.Event) -> None:
        ctx = Z.Context()
        sub = ctx.socket(Z.SUB)
        sub.setsockopt(Z.SUBSCRIBE, b"")
        sub.setsockopt(Z.LINGER, 0)
        sub.connect(self.endpoint)
        ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                raw_events = batch.get("events", []) if isinstance(batch, dict) else batch[1]
                with self._lock:
                    self.events.extend(_event(e) for e in raw_events)
        finally:
            sub.close()
            ctx.term()

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def stored(self) -> list[Event]:
        return [e for e in self.snapshot() if e.tag == "BlockStored"]

    def stored_pages(self) -> int:
        return sum(len(e.fields.get("block_hashes") or ()) for e in self.stored())

    def summary(self) -> dict[str, Any]:
        """Counts by tag; the stored pages and tokens, their media and every field name BlockStored carried."""
        evs = self.snapshot()
        tags: dict[str, int] = {}
        for e in evs:
            tags[e.tag] = tags.get(e.tag, 0) + 1
        stored = [e for e in evs if e.tag == "BlockStored"]
        return {
            "events": tags,
            "stored_pages": sum(len(e.fields.get("block_hashes") or ()) for e in stored),
            "stored_tokens": sum(len(e.fields.get("token_ids") or ()) for e in stored),
            "media": sorted({str(e.fields.get("medium")) for e in stored}),
            "stored_fields": sorted({k for e in stored for k in e.fields}),
            "other_fields": {
                k: sorted({str(e.fields.get(k)) for e in stored})
                for k in ("locality", "ownership", "lora_name", "group_idx")
                if any(k in e.fields for e in stored)
            },
        }


@dataclass
class PdEngines:
    """P/D on real vLLM: a producer and a consumer sharing ``storage`` through vLLM's ExampleConnector."""

    producer: VllmProcess
    consumer: VllmProcess
    storage: Path
    workdir: Path


PD_PAGE = 32  # the P/D engines' page (--block-size)
PRODUCER, CONSUMER = "vllm-producer", "vllm-consumer"  # the pool's backend names (and the listener's sources)
SIDECAR_READY = "kv-epp pd-sidecar ready"


class OutsideHost:
    """A TCP listener outside the pool that counts the connections it accepts: a client's choice of prefill target,
    which must never be connected to."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class PdStack:
    """``kv-epp pd-sidecar`` (``--kv-connector shared-storage``) in front of the consumer, the kv-listener on both
    engines, the picker (disaggregation on; the producer ``prefill``, the consumer ``decode`` at its sidecar's
    address) and Envoy; the counters the tests read, each from its own process."""

    def __init__(self, engines: PdEngines, disaggregation: dict[str, Any] | None = None) -> None:
        self.engines = engines
        self.workdir = engines.workdir
        # the cost model decides (reason cost), with room: on these CPUs the predicted remote and local prefills are
        # close, and the streamed test's first transfer sample replaces the prior, so at the default ratio (1.2)
        # a later long prompt could turn cheaper_local by the tests' order alone
        self.disaggregation = {"enabled": True, "max_ttft_ratio": 10.0, **(disaggregation or {})}
        self.sidecar_port = free_port()
        self.sidecar_metrics_port = free_port()
        self._procs: list[Any] = []
        self.sidecar: ManagedProcess | None = None
        self.listener: ListenerProcess | None = None
        self.picker: PickerProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self.outside = OutsideHost()

    @property
    def sidecar_address(self) -> str:
        return f"127.0.0.1:{self.sidecar_port}"

    def sidecar_argv(self) -> list[str]:
        e = self.engines
        return [
            sys.executable, "-m", "picker", "pd-sidecar",
            "--host", "127.0.0.1", "--port", str(self.sidecar_port),
            "--model-server-port", str(e.consumer.port),
            "--kv-connector", "shared-storage",
            "--prefill-targets", e.producer.address,  # the SSRF allowlist: the pool's prefill endpoint
            "--metrics-port", str(self.sidecar_metrics_port),
        ]  # fmt: skip

    def picker_config(self) -> dict[str, Any]:
        """Tier 4 over the listener, the engine's own ``/tokenize`` (through the sidecar for the consumer), the
        cost scorer; generous waits (the engines' API servers share two cores with everything else)."""
        e = self.engines
        assert self.listener is not None
        tokenizer = {"source": "engine", "timeout_ms": 5000, "timeout_max_ms": 10000, "block_size": 16}
        checks = {"self_check_timeout_seconds": 60, "ready_grace_seconds": 5}
        cfg = kv_picker_config([e.producer, e.consumer], self.listener.url, tokenizer=tokenizer, checks=checks)
        cfg["pool"] = {
            "backends": [
                {"name": PRODUCER, "address": e.producer.address, "role": "prefill"},
                {"name": CONSUMER, "address": self.sidecar_address, "role": "decode"},
            ]
        }
        cfg["disaggregation"] = self.disaggregation
        return cfg

    def start(self) -> None:
        e = self.engines
        self.sidecar, _ = spawn_ready_line("pd-sidecar", self.sidecar_argv(), self.workdir, SIDECAR_READY)
        self._procs.append(self.sidecar)
        sources = listener_sources([e.producer, e.consumer], MODEL_NAME)
        self.listener = start_listener({"feed": {"keepalive_seconds": 0.5}, "sources": sources}, self.workdir)
        self._procs.append(self.listener)
        self.picker = start_picker(self.picker_config(), self.workdir, name="pd-picker")
        self._procs.append(self.picker)
        # the self-checks send their probes to both engines: done before any test counts the engines' requests
        wait_until(
            lambda: "pending" not in {v["self_check"] for v in self.admin("/readyz")["kv_feeds"].values()},
            timeout=120.0,
            what="both self-checks",
        )
        self.envoy = start_envoy(
            EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                         backends=(self.sidecar_address, e.producer.address), first_byte_timeout_s=300,
                         response_mode="full",  # the picker reads streamed P/D answers: transfer-cost samples
                         **self.picker.envoy_picker_options()),
            self.workdir,
        )  # fmt: skip
        self._procs.append(self.envoy)

    def stop(self) -> None:
        for p in reversed(self._procs):
            p.stop()
        self._procs.clear()
        self.outside.close()

    # -- what each process counts -------------------------------------------------------------------
    def picker_metric(self, name: str, **labels: str) -> float:
        assert self.picker is not None
        return metric(http("GET", self.picker.admin_url + "/metrics").body.decode(), name, labels)

    def sidecar_metric(self, name: str, **labels: str) -> float:
        body = http("GET", f"http://127.0.0.1:{self.sidecar_metrics_port}/metrics").body.decode()
        return metric(body, name, labels)

    def admin(self, path: str) -> Any:
        assert self.picker is not None
        return http("GET", self.picker.admin_url + path).json()

    def digests(self) -> dict[str, str]:
        """A digest of what the picker's index holds, per backend: changes when any entry does."""
        return {b["backend_name"]: str(b["entries_digest"]) for b in self.admin("/admin/kv-index/backends")["backends"]}


def metric(text: str, name: str, labels: dict[str, str]) -> float:
    """The sum of a family's series whose labels include ``labels``."""
    return sum(
        v for n, lab, v in parse_prometheus_text(text) if n == name and all(lab.get(k) == x for k, x in labels.items())
    )
