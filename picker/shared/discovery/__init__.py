"""Where the pool's endpoints come from, for the picker and the listener alike.

A discovery source (the InferencePool watcher in ``kubernetes``, the file watcher in ``files``) publishes
``PoolSnapshot``s: the whole set of backends each time it changes. The consumer (the picker's pool, the
listener's sources) diffs two snapshots itself, so a lost or coalesced publication never leaves it wrong.

Readiness gates routing only: a snapshot holds every backend whose pod exists and has an IP, each with its
``ready`` flag (the pod's Ready condition). The picker routes to ready backends only; its Tier 4 feeds and KV
index, and the listener's event sources, follow every backend of the snapshot, so an engine that briefly fails
its readiness probe (busy, not restarted) keeps its KV state everywhere. A backend that leaves the snapshot
(pod deleted, terminating, or without an IP) is dropped everywhere at once.

Naming: a backend is named after its pod; a pool with several target ports (data-parallel ranks of one engine,
one endpoint each) names them ``<pod>.rank<i>``, ``i`` the port's index in ``targetPorts``. The name is the key the
picker and the listener agree on (metric label, KV-index id, feed path segment): both derive it the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol


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


if TYPE_CHECKING:
    from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef


def make_discovery(ref: InferencePoolRef | BackendsFileRef, count: Count | None = None) -> Discovery:
    """The discovery source a ref names: ``KubernetesPoolDiscovery`` for an ``InferencePoolRef``,
    ``FileDiscovery`` for a ``BackendsFileRef`` (imported here, so that importing this package stays cheap)."""
    from picker.shared.discovery.config import InferencePoolRef

    if isinstance(ref, InferencePoolRef):
        from picker.shared.discovery.kubernetes import KubernetesPoolDiscovery

        return KubernetesPoolDiscovery(ref, count)
    from picker.shared.discovery.files import FileDiscovery

    return FileDiscovery(ref, count)
