"""The semantic cache on a real request path: its settings against an embeddings backend, chat bodies (a
question and a near duplicate), two callers (Alice and Bob), routing as a caller, storing an answer and the
semantic-lookup counters."""

from __future__ import annotations

from typing import Any

from benchmarks.engine_sim import EngineSimulator
from picker.config import parse_settings
from picker.facts import Answer
from picker.ops.metrics import PickerMetrics
from picker.request.exchange import Exchange
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support import builders
from tests.support.builders import BACKENDS
from tests.support.embeddings_sim import EMB

QUESTION = (
    "How do I configure the maximum number of cached entries for the response cache in the picker "
    "when running on Kubernetes with three replicas?"
)


NEAR = QUESTION.replace("three", "four")


SYSTEM = "You answer questions about kv-epp."


ANSWER = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Set response_cache.capacity."},'
    b'"finish_reason":"stop"}]}'
)


def sim_url(sim: EngineSimulator) -> str:
    return str(sim.base_url)


def settings(
    backend: str, *, enabled: bool = True, timeout_ms: int = 5000, semantic_extra: dict[str, Any] | None = None,
    cache_extra: dict[str, Any] | None = None, **extra: Any,
) -> Any:  # fmt: skip
    semantic = {"enabled": enabled, "backend": backend, "embedding_model": EMB, "embedding_timeout_ms": timeout_ms}
    semantic.update(semantic_extra or {})
    return parse_settings(
        {
            "pool": {"backends": BACKENDS},
            "admin": {"enabled": False},
            "response_cache": {"enabled": True, "semantic": semantic, **(cache_extra or {})},
            **extra,
        }
    )


def chat(question: str, system: str = SYSTEM, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "temperature": 0, "messages": messages, **fields}


ALICE = {"authorization": "Bearer sk-alice"}


BOB = {"authorization": "Bearer sk-bob"}


async def route(app: PickerApp, data: dict[str, Any], headers: dict[str, str] | None = None) -> Exchange | Answer:
    """Routed as Alice unless ``headers`` say otherwise (the semantic path needs a caller identity)."""
    return await builders.route(app, data, ALICE if headers is None else headers)


async def answer(app: PickerApp, ex: Exchange, body: bytes = ANSWER) -> None:
    ex.cache.headers = ((":status", "200"), ("content-type", "application/json"), ("x-engine", "e1"))
    ex.response_headers(200)
    ex.response_body(body, True)
    await app.response_cache.flush()


def sample(app: PickerApp, name: str, result: str) -> float | None:
    return app.metrics.registry.get_sample_value(name, {"result": result})


def semantic_count(app: PickerApp, result: str) -> float | None:
    return sample(app, "continuum_response_cache_semantic_requests_total", result)


def make(backend: str, **kw: Any) -> PickerApp:
    return build_app(settings(backend, **kw), PickerMetrics())
