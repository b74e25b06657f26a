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

from typing import TYPE_CHECKING

from picker.shared.discovery.model import (
    Count,
    DiscoveredBackend,
    Discovery,
    PoolSnapshot,
    Publish,
    backend_name,
)

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


__all__ = [
    "Count", "DiscoveredBackend", "Discovery", "PoolSnapshot", "Publish", "backend_name", "make_discovery",
]  # fmt: skip
