"""The ``ctx`` fixture: a ZMQ context for real sockets, destroyed (linger 0) after the test. Registered in
tests/unit/conftest.py and tests/integration/conftest.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZMQ context for real sockets, destroyed (linger 0) after the test."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)
