"""A picker whose pool comes from discovery: an InferencePool section (``POOL``), an event-feed template, the
settings of such a picker, a pool snapshot, and a fake discovery the test pushes snapshots through."""

from __future__ import annotations

import asyncio
from typing import Any

from picker.config import parse_settings
from picker.shared.discovery import DiscoveredBackend, PoolSnapshot, Publish

POOL = {"inference_pool": {"name": "vllm", "namespace": "serving"}}


TEMPLATE = {"endpoint": "http://127.0.0.1:1/events/{name}", "reconnect_interval_ms": 60_000}


def discovered_settings(kv: bool = False, **extra: Any) -> Any:
    cfg: dict[str, Any] = {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "pool": {**POOL, "engine_metrics": {"enabled": False}},
        **extra,
    }
    if kv:
        cfg["kv_cache_index"] = {
            "enabled": True,
            "event_source_template": TEMPLATE,
            "checks": {"self_check": False},
            "tokenizer": {"source": "none"},
        }
    return parse_settings(cfg)


def snap(*backends: tuple[str, str], version: str = "1", unready: tuple[str, ...] = ()) -> PoolSnapshot:
    """A snapshot of (name, ip:port) backends; those named in ``unready`` are not Ready."""
    out = []
    for name, addr in backends:
        ip, port = addr.rsplit(":", 1)
        b = DiscoveredBackend(
            name=name, ip=ip, port=int(port), pod=name, namespace="serving", ready=name not in unready
        )
        out.append(b)
    return PoolSnapshot(tuple(sorted(out, key=lambda b: b.name)), source="fake inference_pool", version=version)


class FakeDiscovery:
    """A discovery source the test drives: ``push`` publishes a snapshot (synced from the first one)."""

    def __init__(self) -> None:
        self._synced = False
        self._publish: Publish | None = None
        self.ready = asyncio.Event()

    @property
    def synced(self) -> bool:
        return self._synced

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        self.ready.set()
        await asyncio.Event().wait()  # until cancelled

    def push(self, snapshot: PoolSnapshot) -> None:
        assert self._publish is not None
        self._synced = True
        self._publish(snapshot)

    def status(self) -> dict[str, object]:
        return {"source": "fake", "synced": self._synced}
