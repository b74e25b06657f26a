"""The response cache's per-request state: ``CacheState``, its part of one exchange (``Exchange.cache``), and
``SemanticPending``, a semantic miss on its way to the store. See docs/picker.md, "The response cache".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from picker.cache.vectors import Vector
from picker.facts import RequestFacts


@dataclass(frozen=True, slots=True)
class SemanticPending:
    """A semantic miss: where its response goes once stored (the ``sem:`` entry key, the partition and the
    request's unit vector, indexed after the store write succeeds; ``missed_at``: when the request missed, wall
    clock, recorded in the copy and compared with a tombstone's time)."""

    partition: str
    vector: Vector
    key: str
    missed_at: float = field(default_factory=time.time)


@dataclass(slots=True, eq=False)
class CacheState:
    """The response cache's part of one exchange (``Exchange.cache``): the ``X-Cache`` value of its answer (MISS,
    or BYPASS when the request is not eligible) and, for an eligible miss, the exact ``key`` its response is
    stored under, the ``semantic`` entry too when the semantic path ran and missed, and the response on its way
    to the store: its ``headers`` (kept by the protocol layer for an eligible miss only), its bounded body
    buffer (``buf``, ``size``) and whether the body's ``end_of_stream`` was seen (``complete``)."""

    x_cache: str
    key: str | None = None
    semantic: SemanticPending | None = None
    headers: tuple[tuple[str, str], ...] = ()
    buf: list[bytes] | None = None
    size: int = 0
    complete: bool = False


class CachedExchange(Protocol):
    """What the storing observer reads of an exchange (``picker.request.path.Exchange``)."""

    @property
    def facts(self) -> RequestFacts: ...

    @property
    def cache(self) -> CacheState | None: ...
