"""TaskSupervisor: a crash is logged with the task's name, recorded and reported; stop is bounded."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from picker.shared.supervisor import TaskFailure, TaskSupervisor


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def forever() -> None:
    await asyncio.Event().wait()


async def test_crash_is_logged_recorded_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[TaskFailure] = []

    async def hook(f: TaskFailure) -> None:
        seen.append(f)

    async def crash() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    sup = TaskSupervisor(on_failure=hook)
    with caplog.at_level(logging.ERROR, logger="kv_epp.supervisor"):
        sup.spawn("watcher", forever)
        task = sup.spawn("feed", crash)
        await until(lambda: bool(seen))
    assert [f.task for f in seen] == ["feed"] and isinstance(seen[0].error, ValueError)
    assert not sup.healthy and sup.reason == "background task feed failed: ValueError('boom')"
    assert any("event=task_failed task=feed error=ValueError('boom')" in r.getMessage() for r in caplog.records)
    assert task.done() and task.exception() is None  # the guard consumed it: no "never retrieved" warning
    assert await sup.stop(timeout=5) == []
    assert [f.task for f in sup.failures] == ["feed"]  # cancelling the healthy task is not a failure


async def test_sync_hook_and_a_failing_hook_do_not_escape() -> None:
    calls: list[str] = []

    def hook(f: TaskFailure) -> None:
        calls.append(f.task)
        raise RuntimeError("hook bug")

    async def crash() -> None:
        raise KeyError("k")

    sup = TaskSupervisor(on_failure=hook)
    sup.spawn("a", crash)
    await until(lambda: calls == ["a"])
    assert sup.failures[0].task == "a"
    assert await sup.stop(timeout=5) == []


async def test_cancellation_and_a_normal_return_are_not_failures() -> None:
    async def done() -> None:
        return None

    sup = TaskSupervisor()
    finished = sup.spawn("once", done)
    sup.spawn("loop", forever)
    await finished
    assert await sup.stop(timeout=5) == []
    assert sup.healthy and sup.reason is None


async def test_stop_is_bounded_by_its_deadline() -> None:
    release, started = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()  # ignores cancellation until the test lets it go

    sup = TaskSupervisor()
    task = sup.spawn("stubborn", stubborn)
    sup.spawn("polite", forever)
    await started.wait()  # the cancellation must land inside it, not before its first step
    assert await sup.stop(timeout=0.05) == ["stubborn"]
    release.set()
    await task


async def test_names_are_unique_and_no_spawn_after_stop() -> None:
    sup = TaskSupervisor()
    sup.spawn("x", forever)
    with pytest.raises(ValueError, match="already supervised"):
        sup.spawn("x", forever)
    await sup.stop(timeout=5)
    with pytest.raises(RuntimeError, match="stopping"):
        sup.spawn("y", forever)
