"""The semantic cache parts against the simulator run as a child process (as the stack tests run it): the
embeddings client gets the simulator's vectors, a near-duplicate question hits through the partition
digest and the index, an unrelated one and another system prompt miss."""

from __future__ import annotations

from typing import Any

from benchmarks.engine_sim import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from picker.cache.embeddings import EmbeddingsClient
from picker.cache.semantic import entry_key, semantic_query
from picker.cache.vectors import SemanticIndex

QUESTION = (
    "How do I configure the maximum number of cached entries for the response cache in the picker "
    "when running on Kubernetes with three replicas?"
)


def chat(question: str, system: str = "You answer questions about kv-epp.") -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


async def test_near_duplicate_hits_against_a_simulator_process() -> None:
    with SimulatorProcess(SimConfig(name="emb", model="embedder", time_scale=0.001, kv_events_enabled=False)) as proc:
        client = EmbeddingsClient()
        idx = SemanticIndex(max_entries=1000, ttl_seconds=300, threshold=0.92)

        async def vector_and_partition(data: dict[str, Any]) -> tuple[Any, str, str]:
            q = semantic_query(
                data, path_api="chat", identity="caller", tenant_id="t", embedding_model="embedder",
                max_input_bytes=8192,
            )  # fmt: skip
            assert q is not None
            v = await client.embed(proc.base_url, "embedder", q.text, timeout_ms=5000, max_input_bytes=8192)
            assert v is not None, client.stats
            return v, q.partition, q.text

        try:
            v1, p1, t1 = await vector_and_partition(chat(QUESTION))
            assert idx.add(p1, v1, entry_key(p1, t1))
            v2, p2, _ = await vector_and_partition(chat(QUESTION.replace("three", "four")))
            hit = await idx.lookup_async(p2, v2)
            assert hit is not None and hit.key == entry_key(p1, t1) and hit.similarity >= 0.92
            v3, p3, _ = await vector_and_partition(chat("How do I bake sourdough bread at home with a cast iron pot?"))
            assert await idx.lookup_async(p3, v3) is None
            v4, p4, _ = await vector_and_partition(chat(QUESTION.replace("three", "four"), system="You are a pirate."))
            assert p4 != p1 and await idx.lookup_async(p4, v4) is None
        finally:
            await client.close()
    assert proc.pid is None
