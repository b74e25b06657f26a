"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from tests.support.embeddings_sim import sim  # noqa: F401  (a fixture: the simulator's /v1/embeddings; a module may define its own)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZMQ context for real sockets, destroyed (linger 0) after the test."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)
