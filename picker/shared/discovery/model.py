"""What a discovery source publishes and how it is used: ``PoolSnapshot`` (every backend, ``DiscoveredBackend``),
the backend naming rule and the ``Discovery`` Protocol. The package's docstring says how they are used."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DiscoveredBackend:
    """One endpoint: a pod's IP and one of the pool's target ports; ``ready``: the pod's Ready condition (the
    picker routes only to ready backends; Tier 4 and the listener follow every one)."""

    name: str  # backend name (see backend_name)
    ip: str  # the pod IP, as the API server gives it (no brackets)
    port: int
    rank: int = 0  # the port's index in the pool's targetPorts (data-parallel rank)
    pod: str = ""
    namespace: str = ""
    annotations: tuple[tuple[str, str], ...] = field(default=())  # the pod's annotations, sorted by key
    ready: bool = True
    role: str = "both"  # P/D: prefill | decode | both (the pod label llm-d.ai/role; role_of)

    @property
    def address(self) -> str:
        """``ip:port`` in the picker's canonical form (IPv6 in brackets, compressed)."""
        ip = ipaddress.ip_address(self.ip)
        return f"[{ip.compressed}]:{self.port}" if ip.version == 6 else f"{ip}:{self.port}"

    def annotation(self, key: str) -> str | None:
        for k, v in self.annotations:
            if k == key:
                return v
        return None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Every backend at one moment (ready or not), sorted by name; ``source`` says where it came from (for logs
    and /admin), ``version`` the API resourceVersion or the file's mtime it reflects."""

    backends: tuple[DiscoveredBackend, ...]
    source: str
    version: str = ""

    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    def ready_names(self) -> tuple[str, ...]:
        """The names of the backends to route to (their pods are Ready)."""
        return tuple(b.name for b in self.backends if b.ready)


ROLE_LABEL = "llm-d.ai/role"  # llm-d's P/D role label on a model server's pod (docs/pd.md)
ROLES = ("prefill", "decode", "both")
# llm-d's label values: prefill-decode (and our ``both``) serve either leg; encode variants are not text roles
_ROLE_VALUES = {"prefill": "prefill", "decode": "decode", "prefill-decode": "both", "both": "both"}


def role_of(label: str | None) -> str:
    """The P/D role a pod label value names: ``prefill``, ``decode`` or ``both`` (no label, ``prefill-decode``,
    ``both``, or a value this picker does not know, such as llm-d's encode roles: it serves whole requests)."""
    if not label:
        return "both"
    return _ROLE_VALUES.get(label.strip().lower(), "both")


def backend_name(pod: str, rank: int, ports: int) -> str:
    """The backend name of ``pod``'s ``rank``-th target port when the pool has ``ports`` target ports."""
    return pod if ports <= 1 else f"{pod}.rank{rank}"


# Called with each new snapshot, synchronously, on the event loop of the discovery task.
Publish = Callable[[PoolSnapshot], None]
# Called with a short event name ("list", "watch_event", "bookmark", "gone", "error", "resync", ...): metrics.
Count = Callable[[str], None]


class Discovery(Protocol):
    """A source of pool snapshots. ``run`` publishes the first snapshot once the initial list is complete
    (then ``synced`` is True) and one per change after; it retries failures itself with a bounded backoff and
    keeps the last snapshot meanwhile (an unreachable API server never empties the pool); it returns only by
    cancellation."""

    @property
    def synced(self) -> bool: ...

    async def run(self, publish: Publish) -> None: ...

    def status(self) -> dict[str, object]:
        """JSON-ready state for /admin and /readyz: source, synced, backends, last error, counters."""
        ...
