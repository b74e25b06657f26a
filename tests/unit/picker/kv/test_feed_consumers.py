"""The Tier 4 background work runs as one supervised unit: a crash inside surfaces, it is not swallowed."""

from __future__ import annotations

import asyncio

import pytest

from picker.kv.feed_consumers import KvFeedConsumers
from picker.kv.index import InMemoryKvIndex


class BrokenSweepIndex(InMemoryKvIndex):
    def sweep_expired(self, now: float | None = None, budget: int | None = None) -> int:
        raise RuntimeError("sweep bug")


async def test_a_crashed_sweep_ends_the_group_with_its_error() -> None:
    consumers = KvFeedConsumers((), BrokenSweepIndex(), sweep_interval_s=0.0)
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(consumers.run(), timeout=30)
    assert info.group_contains(RuntimeError, match="sweep bug")


async def test_run_is_cancellable() -> None:
    consumers = KvFeedConsumers((), InMemoryKvIndex(), sweep_interval_s=3600)
    task = asyncio.create_task(consumers.run())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
