"""The picker's feed consumers as a set that follows the pool (``KvFeedConsumers``: one consumer per feed, SSE or
gRPC by the endpoint's scheme) and the KV index's TTL sweep, run together under the supervisor.
See docs/picker.md, "The feed consumers".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from picker.config import EventSourceConfig
from picker.kv.feed_consumer import ConsumerStats, KvFeedConsumer
from picker.kv.grpc_feed_consumer import GrpcFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics


def make_consumer(
    source: EventSourceConfig,
    index: InMemoryKvIndex,
    metrics: PickerMetrics | None = None,
    key_block_size: int | None = None,
) -> KvFeedConsumer:
    """The consumer for the source's endpoint scheme: gRPC for grpc:// and grpcs://, else SSE."""
    if source.endpoint.startswith(("grpc://", "grpcs://")):
        return GrpcFeedConsumer(source, index, metrics, key_block_size=key_block_size)
    return KvFeedConsumer(source, index, metrics, key_block_size=key_block_size)


class KvFeedConsumers:
    """All consumers of a picker plus the index TTL sweep. The set follows the pool: ``add`` starts a
    consumer (at once when ``run`` is running, else when it starts), ``retire`` ends one. Bound: one
    consumer per feed the pool needs."""

    def __init__(
        self,
        sources: tuple[EventSourceConfig, ...],
        index: InMemoryKvIndex,
        metrics: PickerMetrics | None = None,
        sweep_interval_s: float = 30.0,
        key_block_size: int | None = None,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.key_block_size = key_block_size
        self.consumers: dict[str, KvFeedConsumer] = {}
        self.sweep_interval_s = sweep_interval_s
        self.on_change: Callable[[str], None] | None = None  # a consumer's caught_up changed (backend)
        self._group: asyncio.TaskGroup | None = None  # while run() runs
        for s in sources:
            self.add(s)

    def add(self, source: EventSourceConfig) -> KvFeedConsumer:
        """A consumer for ``source`` (replacing none: the caller retires a previous one of that name first)."""
        if source.backend_name in self.consumers:
            raise ValueError(f"a feed consumer for {source.backend_name!r} exists already")
        c = make_consumer(source, self.index, self.metrics, self.key_block_size)
        c.on_change = self._changed
        self.consumers[source.backend_name] = c
        if self._group is not None:
            self._start(c)
        return c

    def retire(self, backend: str) -> KvFeedConsumer | None:
        """End ``backend``'s consumer now (synchronous: its task is cancelled and applies nothing more)."""
        c = self.consumers.pop(backend, None)
        if c is not None:
            c.retire()
        return c

    def _start(self, c: KvFeedConsumer) -> None:
        assert self._group is not None
        c._task = self._group.create_task(c.run(), name=f"kv-feed-{c.backend}")

    def _changed(self, backend: str) -> None:
        if self.on_change is not None:
            self.on_change(backend)

    async def run(self) -> None:
        """Run every consumer and the index sweep until cancelled. They run in one task group: if one
        of them dies (a bug: consumers retry every expected failure themselves), the others are
        cancelled and the error propagates to the process's supervisor, which flips readiness. A retired
        consumer's cancellation is not an error."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for c in self.consumers.values():
                    self._start(c)
                group.create_task(self._sweep_loop(), name="kv-index-sweep")
        finally:
            self._group = None
            for c in list(self.consumers.values()):
                await c.stop()  # closes each consumer's HTTP session or gRPC channel

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            # bounded work per step, yielding between steps, so the loop never stalls
            while self.index.sweep_expired(budget=10_000) >= 10_000:
                await asyncio.sleep(0)
            while self.index.scrub_step(budget=10_000):  # dead backends' bits, in bounded steps
                await asyncio.sleep(0)
            if self.metrics is not None:
                self.metrics.kv_index_entries.set(self.index.entry_count)

    def interrupt_all(self) -> None:
        """After the index dropped entries behind the feeds' back (an admin clear): resubscribe every feed."""
        for c in self.consumers.values():
            c.interrupt()

    def stats(self) -> list[ConsumerStats]:
        return [c.stats for c in self.consumers.values()]
