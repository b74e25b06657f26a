"""The SSRF rule: a prefill leg goes only to an ``ip:port`` of the pool. The allowed set is a static list, or the
backends of a discovery source (a backends file, an InferencePool), replaced whole on each snapshot. Addresses are
compared in canonical form (``picker.shared.discovery.config.canonical_ip_port``: IPv6 bracketed and compressed).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from picker.shared.discovery import PoolSnapshot

log = logging.getLogger("kv_epp.pd_sidecar")


class Verdict(enum.Enum):
    ALLOWED = "allowed"
    NOT_IN_POOL = "not_in_pool"  # 403
    NOT_SYNCED = "not_synced"  # the discovery source has published nothing yet: 503, the pool is unknown


class Allowlist:
    """The allowed prefill targets. ``static`` lists them once; ``follow`` starts empty and not synced, and takes
    each snapshot a discovery source publishes (``publish``): every backend of the pool, ready or not (readiness
    is routing's business; membership is the security rule). Bounded by the pool's size (the discovery sources'
    own bounds: ``MAX_BACKENDS``, ``max_pods``)."""

    def __init__(
        self, targets: frozenset[str], synced: bool, source: str, on_change: Callable[[], None] | None
    ) -> None:
        self._targets = targets
        self._synced = synced
        self.source = source
        self._on_change = on_change

    @classmethod
    def static(cls, targets: frozenset[str], on_change: Callable[[], None] | None = None) -> Allowlist:
        return cls(targets, True, f"static({len(targets)})", on_change)

    @classmethod
    def follow(cls, source: str, on_change: Callable[[], None] | None = None) -> Allowlist:
        return cls(frozenset(), False, source, on_change)

    @classmethod
    def off(cls) -> Allowlist:
        """SSRF protection off (``--ssrf-protection off``): every target is allowed."""
        return cls(frozenset(), True, "off", None)

    @property
    def protecting(self) -> bool:
        return self.source != "off"

    @property
    def synced(self) -> bool:
        return self._synced

    def __len__(self) -> int:
        return len(self._targets)

    def check(self, target: str) -> Verdict:
        """``target`` must be canonical (``canonical_ip_port``)."""
        if not self.protecting:
            return Verdict.ALLOWED
        if not self._synced:
            return Verdict.NOT_SYNCED
        return Verdict.ALLOWED if target in self._targets else Verdict.NOT_IN_POOL

    def publish(self, snapshot: PoolSnapshot) -> None:
        """A discovery source's snapshot: the allowed set becomes its backends' addresses."""
        targets = frozenset(b.address for b in snapshot.backends)
        first = not self._synced
        self._synced = True
        if targets != self._targets or first:
            log.info(
                "event=allowlist_updated source=%r targets=%d version=%s", snapshot.source, len(targets),
                snapshot.version,
            )  # fmt: skip
        self._targets = targets
        if self._on_change is not None:
            self._on_change()
