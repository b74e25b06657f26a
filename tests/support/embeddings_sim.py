"""The engine simulator as an embeddings backend for the semantic-cache tests: its deterministic
``/v1/embeddings`` on a free port, serving the model ``EMB``, stopped at teardown. The ``sim`` fixture is
registered in tests/integration/conftest.py (a test module's own ``sim`` fixture takes precedence there)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from benchmarks.engine_sim import EngineSimulator, SimConfig

EMB = "sim-model"  # the embedding model the simulator serves here


@pytest.fixture
async def sim() -> AsyncIterator[EngineSimulator]:
    simulator = EngineSimulator(SimConfig(time_scale=0.001, kv_events_enabled=False, model=EMB))
    await simulator.start()
    try:
        yield simulator
    finally:
        await simulator.stop()
