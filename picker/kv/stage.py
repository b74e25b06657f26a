"""Tier 4 on the request path: ``KvLookup``, what Tier 4 found for one request, and ``KvStage``, the bookkeeping
the prepare and commit stages do with it (this picker's recent placements, the held prefix's demand, the
prediction and the prefill to watch). ``KvCommit`` is Tier 4's part of the exchange that follows.
See docs/picker.md, "Tier 4 on the request path".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from picker.config import KvCacheIndexConfig
from picker.kv.checks import full_page_blocks
from picker.kv.placements import PrefillWaiter, RecentPlacements, merge
from picker.kv.popularity import PrefixRates
from picker.routing.core import Prepared
from picker.routing.endpoints import BackendHold

_mono = time.monotonic


@dataclass(slots=True, eq=False)
class KvLookup:
    """Tier 4's answer for one request: backend → the prefix it holds (the routing pool's backends only), the
    prompt's length in tokens (the best estimate: exact when the whole prompt was tokenized, else a cached
    prefix's count plus the rest at that prefix's tokens per byte; None: not tokenized, a Tier 4 fallback),
    ``exact`` (every token was known; reported, not used for routing), the request's ``block_keys`` (they may
    cover only a cached prefix of the prompt), the backends whose cache is full (``evicting``: they evicted
    recently) and, once the prepare stage has counted it, ``prefix_rate`` (requests per second for the deepest
    held prefix, lately)."""

    holds: dict[str, BackendHold] = field(default_factory=dict)
    prompt_tokens: int | None = None
    exact: bool = False
    block_keys: Sequence[int] = ()
    evicting: frozenset[str] = frozenset()
    prefix_rate: float = 0.0


@dataclass(slots=True, frozen=True)
class KvPlan:
    """The commit stage's Tier 4 figures for the pick: the cached tokens the decision counts on there (capped at
    the prompt), and the key blocks the engine stores at prefill (``watched``; the last one's store ends the
    request's pending prefill when ``watch``: the pick does not hold them yet)."""

    prompt_tokens: int
    predicted_cached: int
    watched: int
    watch: bool

    @property
    def prefill(self) -> int:
        """The prompt tokens the pick has to prefill."""
        return self.prompt_tokens - self.predicted_cached


@dataclass(slots=True, eq=False)
class KvCommit:
    """Tier 4's part of one exchange (``Exchange.kv``): the prompt's tokens, the cached tokens the decision
    counted on (``predicted_cached``, the pick's) and could have had (``available_cached``, the best holder's),
    and the recent placement the commit made (undone when the response fails there)."""

    prompt_tokens: int
    predicted_cached: int
    available_cached: int
    placed: tuple[RecentPlacements, str, Sequence[int]] | None = None

    def unplace(self) -> None:
        """The request was not cached where it was placed after all (it failed, or another endpoint served it)."""
        if self.placed is not None:
            placements, name, keys = self.placed
            placements.unrecord(name, keys)
            self.placed = None


class KvStage:
    """Tier 4's bookkeeping around the index's answer, one per request path. ``placements`` and the prefix rates
    are built once (``kv_cache_index`` is restart-required)."""

    def __init__(self, cfg: KvCacheIndexConfig) -> None:
        self.block_size = cfg.tokenizer.block_size
        self.placements = RecentPlacements(cfg.recent_placements_max_entries, cfg.recent_placements_seconds)
        self.prefix_rates = PrefixRates()  # how often each held prefix is asked for, for the cost model

    def settle(self, looked: KvLookup) -> KvLookup:
        """The prepare stage: this picker's recent placements added to the index's holds (in place), and the
        deepest held prefix counted as asked for (its rate before this request: what a copy would serve)."""
        keys = looked.block_keys
        if keys and self.placements.ttl > 0:
            merge(looked.holds, self.placements.holds(keys, _mono()))
        holds = looked.holds
        if keys and holds:
            deepest = max(h.blocks for h in holds.values())
            if 0 < deepest <= len(keys):
                looked.prefix_rate = self.prefix_rates.hit(keys[deepest - 1], _mono())
        return looked

    def plan(self, prepared: Prepared, name: str, page: int | None) -> KvPlan | None:
        """The commit stage, before the lease: what the decision counts on at ``name`` and which block's store
        ends its prefill. ``page``: the engine's page size (an engine stores only full pages: a block in the
        prompt's partial last page is stored, if ever, once decoding fills it, and timing it would teach the TTFT
        model the decode time as prefill). None when the prompt was not tokenized."""
        tokens = prepared.prompt_tokens
        if tokens is None:
            return None
        held = prepared.holds.get(name) if prepared.holds else None
        predicted = min(held.blocks * self.block_size, tokens) if held else 0
        keys = prepared.block_keys
        watched = full_page_blocks(tokens, len(keys), page, self.block_size) if keys else 0
        return KvPlan(tokens, predicted, watched, watched > 0 and (held.blocks if held else 0) < watched)

    def commit(self, plan: KvPlan, prepared: Prepared, name: str, lease: PrefillWaiter) -> KvCommit:
        """The commit stage, after the lease: the placement remembered (the prepare stage adds it to later
        requests' holds until the feed says), the lease told when the watched block is stored there."""
        keys = prepared.block_keys
        placed = None
        if keys:
            if self.placements.ttl > 0:
                self.placements.record(name, keys, _mono())
                placed = (self.placements, name, keys)
            if plan.watch:
                self.placements.watch(name, keys[plan.watched - 1], lease)
        best = available(prepared.holds, plan.prompt_tokens, self.block_size)
        return KvCommit(plan.prompt_tokens, plan.predicted_cached, best, placed)


def available(holds: Mapping[str, BackendHold] | None, prompt: int, block_size: int) -> int:
    """The prompt tokens the best holder holds (capped at the prompt)."""
    return max((min(h.blocks * block_size, prompt) for h in (holds or {}).values()), default=0)
