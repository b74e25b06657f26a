"""Fixtures the unit tests share."""

from __future__ import annotations

from tests.support.embeddings_sim import sim  # noqa: F401  (a fixture: the simulator's /v1/embeddings; a module may define its own)
from tests.support.zmq_context import ctx  # noqa: F401  (a fixture: a ZMQ context, destroyed after the test)
