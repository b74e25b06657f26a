"""Where the pool's endpoints come from, for the picker and the listener alike: discovery sources publish whole
``PoolSnapshot``s (``model``); ``make_discovery`` builds the one a config names.
See docs/picker.md, "Pool discovery".
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
