"""What the P/D tests of the real-engine tier share: prompts of a known size, timed requests straight to an engine,
its own counters, and a tap on its KV events (a ZMQ subscriber of our own, decoding every field vLLM sends)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq as _zmq

from benchmarks.loadgen import parse_prometheus_text
from benchmarks.vllm_engine.process import MODEL_NAME, VllmProcess
from tests.integration.conftest import http

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
    body = http("GET", engine.base_url + "/metrics", timeout=30).body.decode()
    return sum(v for n, _, v in parse_prometheus_text(body) if n == name)


@dataclass
class Event:
    tag: str
    fields: dict[str, Any]  # the map form's fields, or the array form's known positions by name


# vLLM's array form (before its map form): the tag, then these fields in order (WIRE.md §3)
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
