"""Poll until a condition holds, with a deadline: the tests' one way to wait for something to happen.

A fixed sleep either waits too long or, on a loaded machine, not long enough; these return as soon as
the condition holds and fail with a message naming it when the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Call ``predicate`` every ``interval`` s until it returns a truthy value, and return that value.

    Raises AssertionError naming ``what`` (or the predicate) after ``timeout`` s. The predicate is always
    called at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or _name(predicate)}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.005, what: str = ""
) -> T:
    """``wait_until`` for the event loop: ``predicate`` may be a plain or an async function; the loop keeps
    running between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return cast(T, value)
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or _name(predicate)}")
        await asyncio.sleep(interval)


def _name(predicate: Callable[..., object]) -> str:
    return getattr(predicate, "__qualname__", repr(predicate))
