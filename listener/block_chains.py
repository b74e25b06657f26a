"""The block-chain tracker: one source's engine pages → the project's block keys, kept exact through stores,
copies, removals and clears, within the per-source memory limits; and ``work_units``, which slices a decoded
batch so a source can yield between slices with the effect of applying it whole.

One cohesive thing over ~450 lines: the key regrouping, the copy accounting and the bounds act on the same nodes
and must change together (the state log in ``listener.state_log`` mirrors these presence rules); ``work_units``
splits an event with the tracker's own semantics (the page check, the parent chaining). The rules (keys, anchors
and tails, presence per group and medium, tiers, bounds) are in docs/listener.md#block-chains.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.events import (
    GPU_LABEL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    SourceReset,
    medium_label,
)
from picker.shared.block_keys import chain_packed_keys, root_key

log = logging.getLogger("kv_listener.block_chains")

GPU = "gpu_hot"
WARM = "storage_warm"
_OFFLOAD_LABEL = "~OFFLOAD"  # synthetic copy of treat_eviction_as_offload
MAX_COPIES_PER_NODE = 64  # distinct (group, medium) pairs a node may hold; more is a hostile stream
MAX_ROOTS_CACHED = 1024
DEFAULT_KEY_BLOCK_SIZE: int = ListenerConfig.model_fields["key_block_size"].default


class DeltaSink(Protocol):
    """Where index deltas go (the feed hub of one backend)."""

    def emit(self, op: str, keys: list[int], tier: str | None, page: int = 0) -> None: ...

    def clear(self, reason: str) -> None: ...


@dataclass(slots=True)
class _Node:
    parent: int | None  # engine hash of the parent page, for chain reconstruction
    chain_tokens: int  # tokens from the chain root to the end of this page
    anchor: int | None = None  # None: tracked without attribution (children cannot be keyed)
    tail: bytes = b""  # packed uint32 tokens after the anchor (< key_block_size tokens)
    keys: tuple[int, ...] = ()  # keys of the key-blocks ending inside this page
    copies: dict[tuple[int, str], int] = field(default_factory=dict)
    tier: str | None = None  # the tier this node currently contributes to its keys


def event_blocks(event: KvEvent) -> int:
    """The work of one event in blocks (at least 1)."""
    if isinstance(event, BlockStored | BlockRemoved):
        return max(1, len(event.block_hashes))
    return 1


def _split(event: KvEvent, max_blocks: int) -> Iterator[KvEvent]:
    if isinstance(event, BlockRemoved) and len(event.block_hashes) > max_blocks:
        for s in range(0, len(event.block_hashes), max_blocks):
            yield replace(event, block_hashes=event.block_hashes[s : s + max_blocks])
        return
    if not isinstance(event, BlockStored) or len(event.block_hashes) <= max_blocks:
        yield event
        return
    n, bs, hashes = len(event.block_hashes), event.block_size, event.block_hashes
    exact = len(event.token_ids) == n * bs
    first_bad = event.first_unkeyable
    for s in range(0, n, max_blocks):
        e = min(n, s + max_blocks)
        bad = None if first_bad is None or first_bad >= e else max(0, first_bad - s)
        yield replace(
            event,
            block_hashes=hashes[s:e],
            parent_hash=event.parent_hash if s == 0 else hashes[s - 1],
            # a store that fails the page check stays failing in every part (no tokens, same block_size)
            token_ids=event.token_ids[s * bs : e * bs] if exact else [],
            has_extra_keys=False,
            unkeyable_from=bad,
        )


def work_units(events: Iterable[KvEvent], max_blocks: int) -> Iterator[list[KvEvent]]:
    """Consecutive slices of ``events`` of at most ``max_blocks`` blocks each, in order; an event larger
    than that is split into sub-events whose application has the same effect as the whole event."""
    if max_blocks < 1:
        raise ValueError("max_blocks must be >= 1")
    unit: list[KvEvent] = []
    size = 0
    for event in events:
        for part in _split(event, max_blocks):
            w = event_blocks(part)
            if unit and size + w > max_blocks:
                yield unit
                unit, size = [], 0
            unit.append(part)
            size += w
    if unit:
        yield unit


class _Emitter:
    """Coalesces consecutive deltas of the same op and tier, preserving order. ``page``: the engine page size
    of the store being applied (0 outside stores), carried by its puts."""

    __slots__ = ("keys", "op", "page", "sink", "tier")

    def __init__(self, sink: DeltaSink, page: int = 0) -> None:
        self.sink = sink
        self.page = page
        self.op = ""
        self.tier: str | None = None
        self.keys: list[int] = []

    def add(self, op: str, key: int, tier: str | None) -> None:
        if self.keys and (op != self.op or tier != self.tier):
            self.flush()
        self.op, self.tier = op, tier
        self.keys.append(key)

    def flush(self) -> None:
        if self.keys:
            self.sink.emit(self.op, self.keys, self.tier, self.page if self.op == "put" else 0)
            self.keys = []


class BlockChainTracker:
    """Per-source chain state. ``apply`` is synchronous and bounded in time by the event size."""

    def __init__(
        self,
        source: SourceConfig,
        limits: LimitsConfig,
        sink: DeltaSink,
        count: Callable[[str, int], None] | None = None,
        key_block_size: int | None = None,
    ) -> None:
        self.source = source
        self.limits = limits
        self.sink = sink
        self.key_block_size = key_block_size or DEFAULT_KEY_BLOCK_SIZE
        self._count = count or (lambda reason, n: None)
        self._roots: dict[tuple[str | None, str | None], int] = {}
        # engine hash → node; insertion order = age (re-stored nodes move to the end)
        self._nodes: dict[int, _Node] = {}
        # block key → [gpu owners, storage owners]; the tier sent downstream is derived from it
        self._key_refs: dict[int, list[int]] = {}
        # engine hash → packed uint32 token ids of that page; oldest first, bounded by max_retained_tokens
        self._segments: dict[int, bytes] = {}
        self._retained_tokens = 0
        self._secondary_groups: set[int] = set()
        self._full_group_seen = False
        self._warned_mismatch = False

    # -- introspection -------------------------------------------------------------------------
    @property
    def tracked_blocks(self) -> int:
        return len(self._nodes)

    @property
    def retained_tokens(self) -> int:
        return self._retained_tokens

    @property
    def keyed_blocks(self) -> int:
        return len(self._key_refs)

    def key_of(self, engine_hash: int) -> int | None:
        """The last key owned by this page (its only one when pages are key blocks), or None."""
        node = self._nodes.get(engine_hash)
        return node.keys[-1] if node is not None and node.keys else None

    def keys_of(self, engine_hash: int) -> tuple[int, ...]:
        """Every key owned by this page (the key-blocks that end inside it)."""
        node = self._nodes.get(engine_hash)
        return () if node is None else node.keys

    def tier_of_key(self, key: int) -> str | None:
        refs = self._key_refs.get(key)
        return None if refs is None else self._refs_tier(refs)

    def chain_token_ids(self, engine_hash: int) -> list[int] | None:
        """The token ids from the chain root to this page, when every segment is still retained."""
        parts: list[bytes] = []
        h: int | None = engine_hash
        while h is not None:
            seg = self._segments.get(h)
            node = self._nodes.get(h)
            if seg is None or node is None:
                return None
            parts.append(seg)
            h = node.parent
        out = array("I")
        for seg in reversed(parts):
            out.frombytes(seg)
        return out.tolist()

    # -- events --------------------------------------------------------------------------------
    def apply(self, event: KvEvent) -> None:
        """Apply one decoded event, emitting the resulting index deltas in order."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event)
        elif isinstance(event, AllBlocksCleared):
            self.reset("all_blocks_cleared")
        elif isinstance(event, SourceReset):
            self.reset("source_reset")

    def apply_all(self, events: Iterable[KvEvent]) -> None:
        """Apply events in order (one work unit of :func:`work_units`)."""
        for event in events:
            self.apply(event)

    def reset(self, reason: str) -> None:
        """Forget everything of this source (engine restart, AllBlocksCleared, unrecoverable gap)."""
        self._nodes.clear()
        self._key_refs.clear()
        self._segments.clear()
        self._retained_tokens = 0
        self._secondary_groups.clear()
        self._full_group_seen = False
        self.sink.clear(reason)

    # -- tiers and references --------------------------------------------------------------------
    @staticmethod
    def _refs_tier(refs: list[int]) -> str | None:
        return GPU if refs[0] > 0 else WARM if refs[1] > 0 else None

    def _node_tier(self, node: _Node) -> str | None:
        skip = self._secondary_groups if self._full_group_seen else ()
        warm = False
        for (group, medium), n in node.copies.items():
            if n <= 0 or group in skip:
                continue
            if medium == GPU_LABEL:
                return GPU
            warm = True
        return WARM if warm else None

    def _ref(self, em: _Emitter, key: int, old: str | None, new: str | None) -> None:
        refs = self._key_refs.get(key)
        if refs is None:
            refs = self._key_refs[key] = [0, 0]
        before = self._refs_tier(refs)
        if old is not None:
            refs[0 if old == GPU else 1] -= 1
        if new is not None:
            refs[0 if new == GPU else 1] += 1
        after = self._refs_tier(refs)
        if after is None:
            del self._key_refs[key]
        if after != before:
            if after is None:
                em.add("del", key, None)
            else:
                em.add("put", key, after)

    def _retier(self, em: _Emitter, node: _Node, new: str | None) -> None:
        old = node.tier
        if new == old:
            return
        node.tier = new
        for key in node.keys:
            self._ref(em, key, old, new)

    def _set_keys(self, em: _Emitter, node: _Node, keys: tuple[int, ...]) -> None:
        if node.tier is not None:
            for key in node.keys:
                self._ref(em, key, node.tier, None)
            for key in keys:
                self._ref(em, key, None, node.tier)
        node.keys = keys

    def _add_copy(self, em: _Emitter, node: _Node, group: int, medium: str) -> None:
        slot = (group, medium)
        if slot not in node.copies and len(node.copies) >= MAX_COPIES_PER_NODE:
            self._count("too_many_copies", 1)
            return
        node.copies[slot] = node.copies.get(slot, 0) + 1
        self._retier(em, node, self._node_tier(node))

    def _drop_node(self, em: _Emitter, engine_hash: int) -> None:
        node = self._nodes.pop(engine_hash)
        self._retier(em, node, None)
        seg = self._segments.pop(engine_hash, None)
        if seg is not None:
            self._retained_tokens -= len(seg) // 4

    # -- stores --------------------------------------------------------------------------------
    def _root(self, lora_name: str | None, cache_salt: str | None) -> int:
        k = (lora_name or None, cache_salt or None)
        root = self._roots.get(k)
        if root is None:
            if len(self._roots) >= MAX_ROOTS_CACHED:
                self._roots.clear()
            root = self._roots[k] = root_key(self.source.model, k[0], k[1])
        return root

    def _start(self, ev: BlockStored) -> tuple[int | None, bytes, int, str | None]:
        """(anchor, tail, chain tokens before the event, reason when unattributed) of the first page."""
        if ev.parent_hash is None:
            if ev.lora_id is not None and not ev.lora_name:
                return None, b"", 0, "lora_without_name"
            return self._root(ev.lora_name, ev.cache_salt), b"", 0, None
        parent = self._nodes.get(ev.parent_hash)
        if parent is None:
            return None, b"", 0, "unknown_parent"
        if parent.anchor is None:
            return None, b"", parent.chain_tokens, "unattributed_parent"
        return parent.anchor, parent.tail, parent.chain_tokens, None

    def _page_check(self, ev: BlockStored) -> bool:
        n, ntok, bs = len(ev.block_hashes), len(ev.token_ids), ev.block_size
        if bs > 0 and ntok == n * bs:
            return True
        # SGLang's partial last page, should it keep the page size in block_size
        return self.source.engine == "sglang" and n == 1 and 0 < ntok < bs

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        group = ev.group_idx or 0
        if ev.secondary_group:
            self._secondary_groups.add(group)
        else:
            self._full_group_seen = True
        medium = medium_label(ev.medium)
        em = _Emitter(self.sink, ev.block_size if self._page_check(ev) else 0)
        if ev.block_size == 0 and not ev.token_ids:
            self._placeholder(em, ev, group, medium)
        elif self._page_check(ev):
            self._stored_pages(em, ev, group, medium)
        elif ev.secondary_group:
            self._count("null_block", n)
        else:
            self._stored_mismatch(em, ev, group, medium)
        self._enforce_limits(em)
        em.flush()

    def _placeholder(self, em: _Emitter, ev: BlockStored, group: int, medium: str) -> None:
        unknown = 0
        for h in ev.block_hashes:
            node = self._nodes.get(h)
            if node is None:
                unknown += 1
            else:
                self._add_copy(em, node, group, medium)
        if unknown:
            self._count("placeholder_unknown", unknown)

    def _stored_mismatch(self, em: _Emitter, ev: BlockStored, group: int, medium: str) -> None:
        n = len(ev.block_hashes)
        self._count("block_size_mismatch", n)
        if not self._warned_mismatch:
            self._warned_mismatch = True
            log.warning(
                "event=block_size_mismatch source=%s event_block_size=%d tokens=%d hashes=%d action=track_without_keys",
                self.source.backend_name,
                ev.block_size,
                len(ev.token_ids),
                n,
            )
        per_page = max(1, len(ev.token_ids) // n if ev.token_ids else ev.block_size)
        base = 0
        if ev.parent_hash is not None and (parent := self._nodes.get(ev.parent_hash)) is not None:
            base = parent.chain_tokens
        parent_hash = ev.parent_hash
        for i, h in enumerate(ev.block_hashes):
            if h not in self._nodes:  # a known page is never changed by a store that fails the check
                node = _Node(parent=parent_hash, chain_tokens=base + (i + 1) * per_page)
                self._nodes[h] = node
                self._add_copy(em, node, group, medium)
            parent_hash = h

    def _stored_pages(self, em: _Emitter, ev: BlockStored, group: int, medium: str) -> None:
        kb = self.key_block_size
        stride = kb * 4
        n, bs = len(ev.block_hashes), ev.block_size
        anchor, tail, chain, reason = self._start(ev)
        first_bad = ev.first_unkeyable
        if reason is not None:
            self._count(reason, n)
        elif first_bad is not None:
            self._count("multimodal", n - first_bad)
        too_long = 0
        keep_segments = self.limits.max_retained_tokens > 0
        max_chain = self.limits.max_chain_tokens
        parent_hash = ev.parent_hash
        all_packed = array("I", ev.token_ids).tobytes()
        pstride = bs * 4
        nodes = self._nodes
        slot = (group, medium)
        # tier of a fresh node holding only this copy (the common case, without the general recount)
        fresh_tier = None if ev.secondary_group and self._full_group_seen else GPU if medium == GPU_LABEL else WARM
        for i, h in enumerate(ev.block_hashes):
            page = all_packed[i * pstride : (i + 1) * pstride]
            ntok = len(page) // 4
            node = nodes.pop(h, None)
            fresh = node is None
            if node is None:
                node = _Node(parent=parent_hash, chain_tokens=chain + ntok)
            nodes[h] = node  # (re)insert at the end: most recent
            if node.anchor is None and anchor is not None and (first_bad is None or i < first_bad):
                # a new page, or one first seen unattributed (a "null" store, an unknown parent): key it
                packed = tail + page if tail else page
                tail_start = chain - len(tail) // 4
                full = len(packed) // stride
                fit = max(0, (max_chain - tail_start) // kb)
                keys = chain_packed_keys(packed[: min(full, fit) * stride], kb, anchor)
                if full > fit:
                    too_long += 1
                    node.anchor, node.tail = None, b""
                else:
                    node.anchor = keys[-1] if keys else anchor
                    node.tail = packed[full * stride :]
                node.chain_tokens = chain + ntok
                node.parent = parent_hash
                if fresh:
                    node.keys = tuple(keys)
                else:
                    self._set_keys(em, node, tuple(keys))
                if keep_segments and h not in self._segments:
                    self._segments[h] = page
                    self._retained_tokens += ntok
            if fresh:
                node.copies[slot] = 1
                node.tier = fresh_tier
                if fresh_tier is not None:
                    for key in node.keys:
                        self._ref(em, key, None, fresh_tier)
            else:
                self._add_copy(em, node, group, medium)
            anchor, tail, chain = node.anchor, node.tail, node.chain_tokens
            parent_hash = h
        if too_long:
            self._count("chain_too_long", too_long)

    def _enforce_limits(self, em: _Emitter) -> None:
        over = len(self._nodes) - self.limits.max_tracked_blocks
        if over > 0:
            oldest = [h for h, _ in zip(self._nodes, range(over), strict=False)]
            for h in oldest:
                self._drop_node(em, h)
            self._count("pruned_blocks", len(oldest))
        if self._retained_tokens > self.limits.max_retained_tokens:
            dropped = 0
            while self._retained_tokens > self.limits.max_retained_tokens and self._segments:
                h = next(iter(self._segments))
                self._retained_tokens -= len(self._segments.pop(h)) // 4
                dropped += 1
            self._count("pruned_token_segments", dropped)

    # -- removals ------------------------------------------------------------------------------
    def _removed(self, ev: BlockRemoved) -> None:
        group = ev.group_idx or 0
        medium = medium_label(ev.medium)
        offload = self.source.treat_eviction_as_offload
        em = _Emitter(self.sink)
        unknown = 0
        for h in ev.block_hashes:
            node = self._nodes.get(h)
            if node is None:
                unknown += 1
                continue
            copies = node.copies
            slot = (group, medium)
            had = copies.get(slot, 0)
            if had > 1:
                copies[slot] = had - 1
            elif had == 1:
                del copies[slot]
            if medium == GPU_LABEL:
                if offload and had == 1:
                    copies[(group, _OFFLOAD_LABEL)] = 1
            else:
                for s in [s for s in copies if s[1] == _OFFLOAD_LABEL]:
                    del copies[s]
            if copies:
                self._retier(em, node, self._node_tier(node))
            else:
                self._drop_node(em, h)
        if unknown:
            self._count("unknown_hash", unknown)
        em.flush()
