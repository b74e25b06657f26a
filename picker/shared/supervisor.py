"""Supervised background tasks for the picker and the listener: a crashed task is logged, counted and makes the
process not ready; it is never restarted, and the stop is always bounded. Imports nothing else of the picker.
See docs/picker.md, "Supervised tasks".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kv_epp.supervisor")


@dataclass(frozen=True, slots=True)
class TaskFailure:
    """One background task that raised: its name and the exception, for logs, metrics and readiness."""

    task: str
    error: BaseException

    @property
    def reason(self) -> str:
        return f"background task {self.task} failed: {self.error!r}"


FailureHook = Callable[[TaskFailure], Awaitable[None] | None]


class TaskSupervisor:
    """Owns a process's background tasks: spawn by name, surface crashes, cancel within a deadline."""

    def __init__(
        self,
        on_failure: FailureHook | None = None,
        logger: logging.Logger | None = None,
        on_spawn: Callable[[str], None] | None = None,
    ) -> None:
        """``on_spawn(name)``: called as each task starts (e.g. a failure counter's series created at 0, so that
        ``increase()`` sees the first crash: a series born at 1 shows no increase)."""
        self._on_failure = on_failure
        self._on_spawn = on_spawn
        self._log = logger or log
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.failures: list[TaskFailure] = []  # bounded: one entry per task name (no restarts)
        self._stopping = False

    def spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """Start ``factory()`` as the supervised task ``name`` (names are unique: they label metrics)."""
        if self._stopping:
            raise RuntimeError("supervisor is stopping: no new tasks")
        if name in self._tasks:
            raise ValueError(f"a task named {name!r} is already supervised")
        if self._on_spawn is not None:
            self._on_spawn(name)
        task = asyncio.create_task(self._guard(name, factory), name=name)
        self._tasks[name] = task
        return task

    async def _guard(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await factory()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # KeyboardInterrupt/SystemExit still end the loop, as asyncio intends
            await self._failed(TaskFailure(name, exc))
        else:
            if not self._stopping:
                self._log.info("event=task_finished task=%s", name)

    async def _failed(self, failure: TaskFailure) -> None:
        self.failures.append(failure)
        self._log.error(
            "event=task_failed task=%s error=%r stopping=%s",
            failure.task, failure.error, self._stopping, exc_info=failure.error,
        )  # fmt: skip
        if self._on_failure is None:
            return
        try:
            result = self._on_failure(failure)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # the hook must not turn one failure into a silent second one
            self._log.error("event=task_failure_hook_failed task=%s error=%r", failure.task, exc)

    @property
    def names(self) -> list[str]:
        return list(self._tasks)

    @property
    def healthy(self) -> bool:
        """False once any task has crashed (it stays false: crashed tasks are not restarted)."""
        return not self.failures

    @property
    def reason(self) -> str | None:
        """Why the process is not ready because of its tasks (the first failure), or None."""
        return self.failures[0].reason if self.failures else None

    async def stop(self, timeout: float) -> list[str]:
        """Cancel every task and wait at most ``timeout`` s; returns the names still running."""
        self._stopping = True
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, timeout))
        stuck = [name for name, t in self._tasks.items() if not t.done()]
        for name in stuck:
            self._log.warning("event=task_stop_timeout task=%s timeout_s=%.1f", name, timeout)
        return stuck
