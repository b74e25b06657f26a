"""The simulator's paged prefix cache (one engine's GPU KV blocks).

Model, following vLLM's V1 block manager in spirit:

- The KV memory is ``capacity_blocks`` slots of ``block_size`` tokens. A running request holds
  ``ceil((prompt + max_tokens) / block_size)`` slots for its whole life; the full prompt blocks that are
  already cached are shared (reference counted), the rest are private slots.
- When a request's prefill completes, its full prompt blocks are stored in the cache under the engine
  hash (a partial trailing block is never cached; generated tokens are not cached). A block that
  another request stored meanwhile is shared instead and the private slot is freed.
- When a request finishes, its references are dropped; a block with no reference becomes evictable.
  Eviction takes the least recently released unreferenced block; blocks referenced by a running
  request are never evicted. Released chains are queued tail first, so a prefix outlives its tails.
- ``reset_prefix_cache`` (vLLM's dev-mode reset) forgets every stored block, and only when no slot is
  held by a running request.
- Cached tokens for a request = the longest run of full blocks, from block 0, already present, capped
  like vLLM so at least the last prompt token is computed: at most ``(prompt_len - 1) // block_size``
  blocks.

Engine hash (deliberately unlike ``picker/block_keys.py``): ``sha256(parent_digest ++ block tokens as
uint32 big-endian)``, where the root parent is ``sha256("kv-sim/root" ++ 0x00 ++ hash_seed)``. The
32-byte digest is the ``bytes`` form of the hash; its last 8 bytes big-endian are the ``uint64`` form
(what vLLM publishes by default); the SGLang form is that value as a signed int64.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import sha256


def root_digest(hash_seed: str = "") -> bytes:
    """Parent digest of block 0 (``hash_seed`` plays the role of vLLM's PYTHONHASHSEED)."""
    return sha256(b"kv-sim/root\x00" + hash_seed.encode("utf-8")).digest()


def engine_block_hashes(token_ids: Sequence[int], block_size: int, hash_seed: str = "") -> list[bytes]:
    """The chained 32-byte engine hashes of the full blocks of ``token_ids`` (partial tail ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    parent = root_digest(hash_seed)
    out: list[bytes] = []
    fmt = f">{block_size}I"
    for i in range(n_blocks):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = sha256(parent + struct.pack(fmt, *block)).digest()
        out.append(parent)
    return out


def hash_as_uint64(digest: bytes) -> int:
    """vLLM's default integer form: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def hash_as_int64(digest: bytes) -> int:
    """SGLang's form: the last 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[-8:], "big", signed=True)


@dataclass(slots=True)
class CachedBlock:
    """One stored full block."""

    digest: bytes
    parent: bytes | None  # None for block 0
    token_ids: tuple[int, ...]
    ref_count: int = 0


@dataclass(slots=True, frozen=True)
class StoredRun:
    """Consecutive blocks stored together (one vLLM ``BlockStored`` event)."""

    digests: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class Allocation:
    """KV slots held by one running request."""

    digests: list[bytes]  # the request's full prompt-block hashes
    hit_blocks: int  # blocks found cached at admission
    private_slots: int  # slots not (yet) shared through the cache
    referenced: list[bytes] = field(default_factory=list)  # cached blocks this request holds a ref on
    generation: int = 0  # the cache generation it was made in; a clear() voids older allocations
    released: bool = False


class PagedPrefixCache:
    """Block-level prefix cache with reference counts and LRU eviction of unreferenced blocks.

    Bound: ``capacity_blocks`` slots in total (cached blocks + private slots of running requests).
    Eviction: least recently released unreferenced block first; referenced blocks are never evicted.
    """

    def __init__(self, block_size: int = 16, capacity_blocks: int = 4096, hash_seed: str = "") -> None:
        if block_size <= 0 or capacity_blocks <= 0:
            raise ValueError("block_size and capacity_blocks must be positive")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.hash_seed = hash_seed
        self._blocks: dict[bytes, CachedBlock] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # unreferenced blocks, LRU first
        self._private_slots = 0
        self._generation = 0

    # -- read side ---------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], namespace: str = "") -> list[bytes]:
        """Engine hashes of the full blocks of ``token_ids``; a LoRA adapter or cache salt (``namespace``)
        gives the whole chain other hashes, as in the engines (no sharing across adapters or salts)."""
        seed = self.hash_seed if not namespace else f"{self.hash_seed}\x00{namespace}"
        return engine_block_hashes(token_ids, self.block_size, seed)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, digest: bytes) -> CachedBlock | None:
        """The cached block with this hash, if stored."""
        return self._blocks.get(digest)

    @property
    def used_slots(self) -> int:
        """Slots in use: every stored block (referenced or evictable) plus private slots."""
        return len(self._blocks) + self._private_slots

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def held_slots(self) -> int:
        """Slots held by running requests: referenced blocks plus private slots."""
        return len(self._blocks) - len(self._evictable) + self._private_slots

    @property
    def usage_fraction(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: slots held by running requests / capacity (0..1)."""
        return self.held_slots / self.capacity_blocks

    def cached_prefix_blocks(self, digests: Sequence[bytes], max_blocks: int | None = None) -> int:
        """Length of the longest run of ``digests`` from block 0 that is cached."""
        limit = len(digests) if max_blocks is None else min(max_blocks, len(digests))
        n = 0
        while n < limit and digests[n] in self._blocks:
            n += 1
        return n

    def slots_needed(self, total_tokens: int) -> int:
        """Slots a request of ``total_tokens`` (prompt + output) holds while running."""
        return -(-total_tokens // self.block_size)

    # -- write side --------------------------------------------------------------------------------
    def try_admit(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        evicted: list[bytes],
        digests: list[bytes] | None = None,
    ) -> Allocation | None:
        """Reserve slots for a request, evicting unreferenced blocks as needed.

        Returns None (nothing changed) when the free and evictable slots cannot hold it. Hashes of
        evicted blocks are appended to ``evicted``. ``digests`` may pass precomputed block hashes.
        """
        if digests is None:
            digests = self.block_hashes(token_ids)
        max_hit = max(0, (len(token_ids) - 1) // self.block_size)
        hit = self.cached_prefix_blocks(digests, max_hit)
        total = self.slots_needed(len(token_ids) + max_tokens)
        new_slots = total - hit
        hit_digests = digests[:hit]
        hit_evictable = sum(1 for d in hit_digests if d in self._evictable)
        free = self.capacity_blocks - self.used_slots
        if free + len(self._evictable) - hit_evictable < new_slots:
            return None
        for d in hit_digests:
            self._ref(d)
        while self.capacity_blocks - self.used_slots < new_slots:
            victim, _ = self._evictable.popitem(last=False)
            del self._blocks[victim]
            evicted.append(victim)
        self._private_slots += new_slots
        return Allocation(digests, hit, new_slots, hit_digests, self._generation)

    def commit_prompt_blocks(self, alloc: Allocation, token_ids: Sequence[int]) -> list[StoredRun]:
        """Store the request's full prompt blocks after its prefill; returns the newly stored runs."""
        if alloc.released or alloc.generation != self._generation:
            return []
        runs: list[StoredRun] = []
        run_digests: list[bytes] = []
        run_start = 0
        bs = self.block_size

        def close_run(end: int) -> None:
            if run_digests:
                parent = alloc.digests[run_start - 1] if run_start > 0 else None
                runs.append(StoredRun(tuple(run_digests), parent, tuple(token_ids[run_start * bs : end * bs])))
                run_digests.clear()

        for i in range(alloc.hit_blocks, len(alloc.digests)):
            d = alloc.digests[i]
            if d in self._blocks:  # stored meanwhile by another request: share it, free our copy
                close_run(i)
                self._ref(d)
            else:
                if not run_digests:
                    run_start = i
                parent = alloc.digests[i - 1] if i > 0 else None
                self._blocks[d] = CachedBlock(d, parent, tuple(token_ids[i * bs : (i + 1) * bs]), 1)
                run_digests.append(d)
            alloc.referenced.append(d)
            alloc.private_slots -= 1
            self._private_slots -= 1
        close_run(len(alloc.digests))
        return runs

    def release(self, alloc: Allocation) -> None:
        """Drop a finished (or aborted) request's references and private slots. Idempotent."""
        if alloc.released or alloc.generation != self._generation:
            alloc.released = True
            return
        alloc.released = True
        self._private_slots -= alloc.private_slots
        alloc.private_slots = 0
        for d in reversed(alloc.referenced):  # tail first: deeper blocks are evicted before the prefix
            block = self._blocks.get(d)
            if block is None:
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                self._evictable[d] = None
        alloc.referenced.clear()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: forget every stored block so no later lookup hits,
        but only when no slot is held by a running request; otherwise change nothing and return False.
        The forgotten blocks are never reported removed (vLLM drops their hashes)."""
        if self.held_slots:
            return False
        self._blocks.clear()
        self._evictable.clear()
        return True

    def clear(self) -> None:
        """Forget everything (engine restart); outstanding allocations become void."""
        self._generation += 1
        self._blocks.clear()
        self._evictable.clear()
        self._private_slots = 0

    def _ref(self, digest: bytes) -> None:
        block = self._blocks[digest]
        if block.ref_count == 0:
            self._evictable.pop(digest, None)
        block.ref_count += 1
