"""Fixtures the unit tests share."""

from __future__ import annotations

from tests.support.zmq_context import ctx  # noqa: F401  (a fixture: a ZMQ context, destroyed after the test)
