"""What the end-to-end Tier 4 tests share: simulated vLLM engines publishing KV events, a picker config
pointed at a listener's feed, and a client for the stack (chat through Envoy, the picker's admin JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import KvEventsSettings
from benchmarks.engine_sim.process import SimulatorProcess
from tests.integration.conftest import http

MODEL = "sim-model"
PIN_HEADER = "x-test-subset"  # Envoy's subset hint: the test pins a request to one engine's address


def start_sims(
    workdir: Path, n: int, capacity_blocks: int, lora_adapters: str = "", **events: Any
) -> list[SimulatorProcess]:
    """``n`` engines ``sim-0..`` (vLLM map encoding, replay on; serving ``lora_adapters``, comma-separated, besides
    the model), started; the caller stops them."""
    sims: list[SimulatorProcess] = []
    for i in range(n):
        sim = SimulatorProcess(
            SimConfig(
                name=f"sim-{i}",
                model=MODEL,
                capacity_blocks=capacity_blocks,
                time_scale=0.02,
                lora_adapters=lora_adapters,
            ),
            KvEventsSettings(
                endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", encoding="map", **events
            ),
            log_path=workdir / f"sim-{i}.log",
        )
        sims.append(sim)
        sim.start()
    return sims


def listener_sources(engines: list[Any], model: str = MODEL) -> list[dict[str, Any]]:
    """A listener source per engine (a simulator or a real vLLM: ``config.name``, the event endpoints)."""
    return [
        {"backend_name": s.config.name, "engine": "vllm", "model": model, "zmq_endpoint": s.kv_events_endpoint,
         "replay_endpoint": s.replay_endpoint}
        for s in engines
    ]  # fmt: skip


def kv_picker_config(
    sims: list[Any], feed_url: str, tokenizer: dict[str, Any] | None = None, **kv: Any
) -> dict[str, Any]:
    """RoundRobin + Tier 4 over the listener at ``feed_url`` for ``sims`` (simulators or real engines: their
    ``config.name`` and ``address``); ``tokenizer`` and ``kv`` override kv_cache_index keys."""
    return {
        "selection_strategy": "RoundRobin",
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {
            "enabled": True,
            "entry_ttl_seconds": 3600,
            "event_sources": [
                {"backend_name": s.config.name, "endpoint": f"{feed_url}/events/{s.config.name}"} for s in sims
            ],
            "tokenizer": tokenizer or {"source": "engine", "timeout_ms": 3000, "block_size": 16},
            **kv,
        },
        "pool": {"backends": [{"name": s.config.name, "address": s.address} for s in sims]},
    }


class KvStackClient:
    """Requests through Envoy and the picker's admin JSON, for a stack of ``sims``, ``picker``, ``envoy``."""

    sims: list[SimulatorProcess]
    picker: Any
    envoy: Any

    def chat(self, system: str, user: str, pin: int | None = None, max_tokens: int = 2) -> str:
        """One chat completion through Envoy (pinned to engine ``pin``); returns the engine that served it."""
        headers = {PIN_HEADER: self.sims[pin].address} if pin is not None else None
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        r = http("POST", self.envoy.url + "/v1/chat/completions", body, headers)
        assert r.status == 200, r.body
        return str(r.headers["x-kv-sim-name"])

    def admin(self, path: str, picker: Any = None) -> Any:
        return http("GET", (picker or self.picker).admin_url + path).json()

    def backends(self, picker: Any = None) -> dict[str, dict[str, Any]]:
        return {b["backend_name"]: b for b in self.admin("/admin/kv-index/backends", picker)["backends"]}

    def entries(self) -> dict[str, int]:
        return {name: int(b["entries"]) for name, b in self.backends().items()}

    def decisions(self) -> dict[str, int]:
        return dict(self.admin("/admin/kv-index/stats")["routing_decisions"])
