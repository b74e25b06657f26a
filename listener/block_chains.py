"""Engine block chains → the project's block keys, per source, within the seed's memory limits.

For every BlockStored the tracker computes our 64-bit chained keys from the event's ``token_ids``
(``picker.shared.block_keys``: rooted in the source's model, LoRA name and cache salt folded in) and keeps an
engine-hash → node map so removals and ``parent_block_hash`` resolve. It emits index deltas (put with a
tier, delete, clear) to a sink, in event order.

Bounds (per source):
- ``max_tracked_blocks`` nodes; beyond it the oldest node is pruned (its key deleted downstream when
  no other node references it). Never a whole-backend reset.
- ``max_retained_tokens`` token ids kept as per-block segments (4 bytes each) for chain
  reconstruction (``chain_token_ids``); oldest segments are dropped first, the node stays keyed.
- ``max_chain_tokens``: blocks whose chain would exceed it are tracked unattributed (no key).
So retained token memory is at most min(max_retained_tokens, max_tracked_blocks * max_chain_tokens) * 4.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from listener.config import LimitsConfig, SourceConfig
from listener.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, SourceReset
from picker.shared.block_keys import chain_block_keys, extra_bytes, root_key

log = logging.getLogger("kv_listener.block_chains")

GPU = "gpu_hot"
WARM = "storage_warm"
_GPU_MEDIA = frozenset({"GPU", "gpu", "cuda", "CUDA"})


class DeltaSink(Protocol):
    """Where index deltas go (the feed hub of one backend)."""

    def emit(self, op: str, keys: list[int], tier: str | None) -> None: ...

    def clear(self, reason: str) -> None: ...


@dataclass(slots=True)
class _Node:
    key: int | None  # None: tracked without attribution (children cannot be keyed)
    chain_tokens: int
    parent: int | None  # engine hash of the parent, for chain reconstruction
    gpu: bool = False
    storage: bool = False


def is_gpu_medium(medium: str | None) -> bool:
    """WIRE.md §3: ``"GPU"`` or null is GpuHot; every other medium is StorageWarm."""
    return medium is None or medium in _GPU_MEDIA


class _Emitter:
    """Coalesces consecutive deltas of the same op and tier, preserving order."""

    __slots__ = ("keys", "op", "sink", "tier")

    def __init__(self, sink: DeltaSink) -> None:
        self.sink = sink
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
            self.sink.emit(self.op, self.keys, self.tier)
            self.keys = []


class BlockChainTracker:
    """Per-source chain state. ``apply`` is synchronous and bounded in time by the event size."""

    def __init__(
        self,
        source: SourceConfig,
        limits: LimitsConfig,
        sink: DeltaSink,
        count: Callable[[str, int], None] | None = None,
    ) -> None:
        self.source = source
        self.limits = limits
        self.sink = sink
        self._count = count or (lambda reason, n: None)
        self._root = root_key(source.model)
        # engine hash → node; insertion order = age (re-stored nodes move to the end)
        self._nodes: dict[int, _Node] = {}
        # block key → [gpu refs, storage refs]; the tier sent downstream is derived from it
        self._key_refs: dict[int, list[int]] = {}
        # engine hash → packed uint32 token ids of that block; oldest first, bounded by max_retained_tokens
        self._segments: dict[int, bytes] = {}
        self._retained_tokens = 0
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
        node = self._nodes.get(engine_hash)
        return None if node is None else node.key

    def chain_token_ids(self, engine_hash: int) -> list[int] | None:
        """The token ids from the chain root to this block, when every segment is still retained."""
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

    def reset(self, reason: str) -> None:
        """Forget everything of this source (engine restart, AllBlocksCleared, unrecoverable gap)."""
        self._nodes.clear()
        self._key_refs.clear()
        self._segments.clear()
        self._retained_tokens = 0
        self.sink.clear(reason)

    def _tier(self, refs: list[int]) -> str | None:
        return GPU if refs[0] > 0 else WARM if refs[1] > 0 else None

    def _ref(self, em: _Emitter, key: int, gpu: int, storage: int) -> None:
        refs = self._key_refs.get(key)
        if refs is None:
            refs = self._key_refs[key] = [0, 0]
        before = self._tier(refs)
        refs[0] += gpu
        refs[1] += storage
        after = self._tier(refs)
        if after is None:
            del self._key_refs[key]
        if after != before:
            if after is None:
                em.add("del", key, None)
            else:
                em.add("put", key, after)

    def _set_flags(self, em: _Emitter, node: _Node, gpu: bool, storage: bool) -> None:
        dg = int(gpu) - int(node.gpu)
        ds = int(storage) - int(node.storage)
        node.gpu, node.storage = gpu, storage
        if node.key is not None and (dg or ds):
            self._ref(em, node.key, dg, ds)

    def _drop_node(self, em: _Emitter, engine_hash: int) -> None:
        node = self._nodes.pop(engine_hash)
        self._set_flags(em, node, False, False)
        seg = self._segments.pop(engine_hash, None)
        if seg is not None:
            self._retained_tokens -= len(seg) // 4

    def _attribution(self, ev: BlockStored) -> tuple[int | None, int, str | None]:
        """(parent key or None when unattributed, parent chain tokens, reason when unattributed)."""
        base = 0
        parent_key: int | None = self._root
        if ev.parent_hash is not None:
            parent = self._nodes.get(ev.parent_hash)
            if parent is None:
                return None, 0, "unknown_parent"
            base = parent.chain_tokens
            parent_key = parent.key
            if parent_key is None:
                return None, base, "unattributed_parent"
        if ev.lora_id is not None and not ev.lora_name:
            return None, base, "lora_without_name"
        if ev.has_extra_keys:
            return None, base, "extra_keys"
        return parent_key, base, None

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        cfg_bs = self.source.block_size
        ntok = len(ev.token_ids)
        parent_key, base, reason = self._attribution(ev)
        if reason is None:
            if ev.block_size == cfg_bs and ntok == n * cfg_bs:
                pass
            elif self.source.engine == "sglang" and ev.block_size < cfg_bs and ntok == n * ev.block_size:
                reason = "partial_block"  # SGLang's last page of a node; the picker keys full blocks only
            else:
                reason = "block_size_mismatch"
                if not self._warned_mismatch:
                    self._warned_mismatch = True
                    log.warning(
                        "event=block_size_mismatch source=%s configured_block_size=%d event_block_size=%d "
                        "tokens=%d hashes=%d action=track_without_tokens",
                        self.source.backend_name,
                        cfg_bs,
                        ev.block_size,
                        ntok,
                        n,
                    )
        if reason is not None:
            self._count(reason, n)
        per_block = cfg_bs if reason is None else max(1, ntok // n if ntok else ev.block_size)
        keys: list[int] = []
        if reason is None and parent_key is not None:
            fit = max(0, (self.limits.max_chain_tokens - base) // cfg_bs)
            if fit < n:
                self._count("chain_too_long", n - fit)
            extra = extra_bytes(ev.lora_name, ev.cache_salt)
            keys = chain_block_keys(ev.token_ids, cfg_bs, parent_key, extra, max_blocks=min(n, fit))
        gpu = is_gpu_medium(ev.medium)
        em = _Emitter(self.sink)
        parent_hash = ev.parent_hash
        keep_segments = self.limits.max_retained_tokens > 0 and reason is None
        for i, h in enumerate(ev.block_hashes):
            node = self._nodes.pop(h, None)
            if node is None:
                key = keys[i] if i < len(keys) else None
                node = _Node(key=key, chain_tokens=base + (i + 1) * per_block, parent=parent_hash)
            self._nodes[h] = node  # (re)insert at the end: most recent
            self._set_flags(em, node, node.gpu or gpu, node.storage or not gpu)
            if keep_segments and node.key is not None and h not in self._segments:
                seg = array("I", ev.token_ids[i * cfg_bs : (i + 1) * cfg_bs]).tobytes()
                self._segments[h] = seg
                self._retained_tokens += cfg_bs
            parent_hash = h
        self._enforce_limits(em)
        em.flush()

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

    def _removed(self, ev: BlockRemoved) -> None:
        gpu_medium = is_gpu_medium(ev.medium)
        em = _Emitter(self.sink)
        unknown = 0
        for h in ev.block_hashes:
            node = self._nodes.get(h)
            if node is None:
                unknown += 1
                continue
            if gpu_medium:
                offload = self.source.treat_eviction_as_offload and node.gpu
                self._set_flags(em, node, False, node.storage or offload)
            else:
                self._set_flags(em, node, node.gpu, False)
            if not node.gpu and not node.storage:
                self._drop_node(em, h)
        if unknown:
            self._count("unknown_hash", unknown)
        em.flush()
