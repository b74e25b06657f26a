"""A stand-in for one vLLM replica, speaking the real interfaces (see docs/benchmarks.md).

Modules:

- ``tokenizer``: deterministic word tokenizer and chat template (import it offline to get the same ids).
- ``prefix_cache``: the paged prefix cache and the engine's own block hash.
- ``kv_events``: vLLM/SGLang KV events over ZMQ (PUB + ROUTER replay).
- ``scheduler``: the continuous-batching timing model.
- ``server``: the aiohttp server and ``EngineSimulator`` (in-process: ``await sim.start()``/``stop()``).
- ``process``: ``SimulatorProcess`` / ``start_simulators`` to run simulators as child processes.
- ``config``: ``SimConfig``, the one place holding every default (CLI flags derive from it).
"""

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import KvEventsSettings
from benchmarks.engine_sim.server import EngineSimulator

__all__ = ["EngineSimulator", "KvEventsSettings", "SimConfig"]
