"""The semantic cache's parts without a request path: chat bodies (a question, a near duplicate, an unrelated
one), a caller identity, a lookup query, a settable clock, an index on it, one embedding through a client,
and the URL of a refused port."""

from __future__ import annotations

import socket
from typing import Any

from picker.cache.embeddings import EmbeddingsClient
from picker.cache.semantic import semantic_query
from picker.cache.vectors import SemanticIndex
from picker.facts import caller_identity
from tests.support.embeddings_sim import EMB

QUESTION = (
    "How do I configure the maximum number of cached entries for the response cache in the picker "
    "when running on Kubernetes with three replicas?"
)


NEAR = QUESTION.replace("three", "four")


OTHER = "Which planets of the solar system have rings, and what are the rings made of?"


SYSTEM = {"role": "system", "content": "You answer questions about kv-epp."}


def chat(question: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "temperature": 0,
        "messages": [SYSTEM, {"role": "user", "content": question}],
    }
    body.update(fields)
    return body


ALICE = caller_identity({"authorization": "Bearer sk-alice"}, "authorization")


def query(
    data: dict[str, Any], tenant: str | None = "t1", max_input_bytes: int = 8192, identity: str | None = ALICE
) -> Any:
    return semantic_query(
        data, path_api="chat", identity=identity, tenant_id=tenant, embedding_model=EMB,
        max_input_bytes=max_input_bytes,
    )  # fmt: skip


# -- the index ------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index(
    max_entries: int = 100, ttl: float = 300.0, threshold: float = 0.92, clock: Clock | None = None
) -> SemanticIndex:
    return SemanticIndex(max_entries=max_entries, ttl_seconds=ttl, threshold=threshold, clock=clock or Clock())


async def embed(client: EmbeddingsClient, backend: str, text: str = QUESTION, **kw: Any) -> Any:
    opts: dict[str, Any] = {"timeout_ms": 2000, "max_input_bytes": 8192}
    opts.update(kw)
    return await client.embed(backend, EMB, text, **opts)


def refused_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"
