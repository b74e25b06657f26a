"""``kv-sim`` / ``python -m benchmarks.engine_sim``: run one simulated vLLM replica.

Every flag comes from ``SimConfig`` and ``KvEventsSettings`` (``--kv-events-...``). The command's own
defaults (``CLI_DEFAULTS``) are those of the first engine of ``examples/`` (``make up``): vLLM's port 8000,
its KV event endpoints ``tcp://*:5557`` (replay ``tcp://*:5558``) and the served model name ``SERVED_MODEL``
(tests/unit/repo/test_examples.py holds the examples to them); a second engine takes ``--name vllm-1
--port 8001 --kv-events-endpoint tcp://*:5567 --kv-events-replay-endpoint tcp://*:5568``. When ready it
prints one JSON line on stdout, ``{"event": "kv_sim_ready", "name", "url", "port",
"kv_events_endpoint", "replay_endpoint"}``, which ``benchmarks.engine_sim.process`` reads to learn the
ports it bound (use ``--port 0`` and ``--kv-events-endpoint tcp://127.0.0.1:0`` for free ports).
Logs go to stderr. SIGTERM/SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from benchmarks.engine_sim.config import SimConfig, add_dataclass_arguments, from_namespace
from benchmarks.engine_sim.kv_events import KvEventsSettings
from benchmarks.engine_sim.server import EngineSimulator

KV_PREFIX = "kv-events-"
# The one place for the model name the examples and `make up` use: the simulator serves it by default.
SERVED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# The command's defaults where they differ from SimConfig's and KvEventsSettings' (which the harnesses use:
# free ports, every flag given explicitly by benchmarks.engine_sim.process): the first engine of examples/.
CLI_DEFAULTS: dict[str, object] = {
    "name": "vllm-0",
    "model": SERVED_MODEL,
    "port": 8000,
    "kv_events_endpoint": "tcp://*:5557",
    "kv_events_replay_endpoint": "tcp://*:5558",
}


def build_parser() -> argparse.ArgumentParser:
    """The CLI parser (flags derived from the config dataclasses)."""
    parser = argparse.ArgumentParser(prog="kv-sim", description="Simulated vLLM replica for kv-epp benchmarks")
    add_dataclass_arguments(parser, SimConfig)
    add_dataclass_arguments(parser.add_argument_group("KV events"), KvEventsSettings, KV_PREFIX)  # type: ignore[arg-type]
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    for action in parser._actions:  # the help text names the default: keep it true
        if action.dest in CLI_DEFAULTS and action.help:
            old = repr(action.default)
            action.default = CLI_DEFAULTS[action.dest]
            action.help = action.help.replace(f"(default: {old})", f"(default: {action.default!r})")
    return parser


async def _serve(sim: EngineSimulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sim.start()
    ready = {
        "event": "kv_sim_ready",
        "name": sim.config.name,
        "url": sim.base_url,
        "port": sim.port,
        "kv_events_endpoint": sim.kv_events_endpoint,
        "replay_endpoint": sim.replay_endpoint,
    }
    print(json.dumps(ready), flush=True)
    try:
        await stop.wait()
    finally:
        await sim.stop()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )
    config = from_namespace(SimConfig, args)
    kv_settings = from_namespace(KvEventsSettings, args, KV_PREFIX)
    asyncio.run(_serve(EngineSimulator(config, kv_settings)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
