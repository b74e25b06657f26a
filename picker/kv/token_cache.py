"""Tier 4's tokenization cache: token ids at message (or chunk) boundaries, verified against later tokenizations,
so a new turn of a seen conversation is keyed without a tokenizer round trip on the request path; the
``CachedTokenizer`` in front of the tokenizer source, with its background fills.
See docs/picker.md, "The tokenization cache".
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from picker.kv.token_keys import (
    Segments,
    chat_segments,
    prompt_segments,
    safe_length,
)
from picker.shared.block_keys import chain_packed_keys

log = logging.getLogger("kv_epp.token_cache")

ENTRY_OVERHEAD = 320  # bytes an entry costs besides its ids: key object, LRU node, Entry, bytes/array headers
MARKER_COST = 160  # bytes a seen marker costs: key object and LRU node
MAX_MODELS = 1024  # models whose trust state is kept
KEY_SLICE_BLOCKS = 64  # a background fill computes block keys this many blocks at a time, yielding between


class Entry:
    """Token ids the cache vouches for. ``packed``: uint32 LE ids (a prefix entry's safe ids, an exact entry's
    ids), at most the cache's ``max_tokens``; ``tokens``: the whole rendering's id count; ``size``: the bytes of
    the segments it covers (the tokens-per-byte ratio of an estimate); ``keys``: memoised block keys of
    ``packed`` for one chain root."""

    __slots__ = ("exact", "keys", "keys_root", "packed", "size", "tokens")

    def __init__(self, packed: bytes, tokens: int, size: int, exact: bool) -> None:
        self.packed = packed
        self.tokens = tokens
        self.size = size
        self.exact = exact
        self.keys_root: int | None = None
        self.keys: array[int] | None = None

    @property
    def cost(self) -> int:
        return ENTRY_OVERHEAD + len(self.packed) + (8 * len(self.keys) if self.keys is not None else 0)


class TokenCache:
    """The LRU of entries and seen markers, bounded by ``max_bytes`` (docs/picker.md, "The tokenization cache")."""

    def __init__(self, max_bytes: int, block_size: int, max_tokens: int) -> None:
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.max_tokens = max(block_size, max_tokens - max_tokens % block_size)
        # key → Entry, or None for a seen marker; LRU order (oldest first). Bound: max_bytes (self.bytes)
        self._items: OrderedDict[bytes, Entry | None] = OrderedDict()
        self.bytes = 0
        self.entries = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return self._items.get(key) is not None

    def get(self, key: bytes) -> Entry | None:
        """The entry at ``key`` (now the most recently used), or None."""
        e = self._items.get(key)
        if e is not None:
            self._items.move_to_end(key)
        return e

    def peek(self, key: bytes) -> Entry | None:
        """The entry at ``key`` without touching its LRU position."""
        return self._items.get(key)

    def seen(self, key: bytes) -> bool:
        """A marker or an entry is at ``key``."""
        return key in self._items

    def mark(self, key: bytes) -> None:
        """Remember that a request reached ``key``: a marker, refreshed; an entry there is left alone."""
        items = self._items
        if key in items:
            if items[key] is None:
                items.move_to_end(key)
            return
        if self.max_bytes < MARKER_COST:
            return
        items[key] = None
        self.bytes += MARKER_COST
        self._evict()

    def put(self, key: bytes, entry: Entry) -> None:
        """Store ``entry`` (its ids cut to ``max_tokens``) as the most recently used; evict to the bound."""
        cap = self.max_tokens * 4
        if len(entry.packed) > cap:
            entry.packed = entry.packed[:cap]
        if entry.cost > self.max_bytes:
            return
        self.remove(key)
        self._items[key] = entry
        self.bytes += entry.cost
        self.entries += 1
        self._evict()

    def remove(self, key: bytes) -> None:
        old = self._items.pop(key, 0)
        if old == 0:
            return
        if old is None:
            self.bytes -= MARKER_COST
        else:
            assert isinstance(old, Entry)
            self.bytes -= old.cost
            self.entries -= 1

    def keys_of(self, key: bytes, entry: Entry, root: int, max_blocks: int) -> Sequence[int]:
        """``entry``'s block keys under ``root`` (memoised: computed once per root; the bytes are booked)."""
        if entry.keys is not None and entry.keys_root == root:
            return entry.keys
        n = min(len(entry.packed) // (4 * self.block_size), max_blocks)
        keys = array("Q", chain_packed_keys(entry.packed[: n * self.block_size * 4], self.block_size, root))
        self._memo(key, entry, root, keys)
        return keys

    def _memo(self, key: bytes, entry: Entry, root: int, keys: array[int]) -> None:
        before = entry.cost
        entry.keys_root, entry.keys = root, keys
        if self._items.get(key) is entry:
            self.bytes += entry.cost - before
            self._evict()

    def _evict(self) -> None:
        items = self._items
        while self.bytes > self.max_bytes and items:
            _, old = items.popitem(last=False)
            if old is None:
                self.bytes -= MARKER_COST
            else:
                self.bytes -= old.cost
                self.entries -= 1
            self.evictions += 1


@dataclass(slots=True)
class Fill:
    """A background tokenization that fills the prefix entry at ``key``; ``parent``: the shorter prefix entry
    a request used (checked against the fill's ids), ``root``: the chain root whose keys to memoise."""

    key: bytes
    model: str
    messages: Sequence[Any] | None
    prompt: str | None
    size: int
    root: int
    parent: bytes | None


@dataclass(slots=True)
class Tokens:
    """A request's token-id answer for Tier 4: block keys, the prompt's length in tokens (exact, or the cached
    prefix's count plus an estimate of the rest), ``exact``, and how it was obtained (``exact``, ``prefix``,
    ``miss``: a round trip on the request path, ``prefix_after_failure``: the round trip failed, a cached
    prefix was used)."""

    keys: Sequence[int]
    prompt_tokens: int
    exact: bool
    how: str


TokenizeFn = Callable[..., Any]  # the source's token_ids coroutine function


class CachedTokenizer:
    """The request path's token ids through the cache, and the background fills. ``counts`` are plain
    integers (lookups by result, fills by outcome, tokenizer calls by path); ``on_count`` is told each one."""

    def __init__(
        self,
        *,
        max_bytes: int,
        block_size: int,
        max_tokens: int,
        min_fraction: float,
        trust_after: int,
        queue_size: int,
        queue_max_bytes: int,
        fill_timeout_s: float,
        on_count: Callable[[str, str], None] | None = None,
    ) -> None:
        self.cache = TokenCache(max_bytes, block_size, max_tokens)
        self.enabled = max_bytes > 0
        self.block_size = block_size
        self.max_blocks = max(1, max_tokens // block_size)
        self.min_fraction = min_fraction
        self.trust_after = trust_after
        self.fill_timeout_s = fill_timeout_s
        self.queue_size = queue_size
        self.queue_max_bytes = queue_max_bytes
        # bound: queue_size fills, queue_max_bytes of their text; ``pending``: their keys plus the running ones
        self._queue: asyncio.Queue[Fill] = asyncio.Queue()
        self.queued_bytes = 0
        self.pending: set[bytes] = set()
        self.trust: dict[str, int] = {}  # model → confirmed prefixes; bound MAX_MODELS
        self.refused: set[str] = set()  # models whose prefixes failed a check; bound MAX_MODELS
        self.counts: dict[tuple[str, str], int] = {}
        self._on_count = on_count

    # -- counting ---------------------------------------------------------------------------------
    def _count(self, what: str, label: str) -> None:
        k = (what, label)
        self.counts[k] = self.counts.get(k, 0) + 1
        if self._on_count is not None:
            self._on_count(what, label)

    def count(self, what: str, label: str) -> int:
        return self.counts.get((what, label), 0)

    # -- trust ------------------------------------------------------------------------------------
    def trusted(self, model: str) -> bool:
        return model not in self.refused and self.trust.get(model, 0) >= self.trust_after

    def _check(self, model: str, parent_key: bytes | None, ids_packed: bytes) -> bool:
        """Is the prefix entry at ``parent_key`` a prefix of ``ids_packed``? Books a confirmation or refuses
        the model. True when there was nothing to check."""
        if parent_key is None:
            return True
        parent = self.cache.peek(parent_key)
        if parent is None or parent.exact:
            return True
        n = len(parent.packed)
        if n < 4 * self.block_size and len(ids_packed) >= n:
            return True  # nothing to compare: no confirmation either
        if len(ids_packed) >= n and parent.packed == ids_packed[:n]:
            if model in self.trust or len(self.trust) < MAX_MODELS:
                self.trust[model] = self.trust.get(model, 0) + 1
            self._count("checks", "confirmed")
            return True
        self.cache.remove(parent_key)
        self._count("checks", "mismatch")
        if model not in self.refused and len(self.refused) < MAX_MODELS:
            self.refused.add(model)
            log.warning(
                "event=token_cache_refused model=%r reason='a cached prefix is not a prefix of a longer "
                "prompt of the same conversation: the chat template or tokenizer is not prefix-preserving at "
                "message boundaries' action='cached prefixes of this model are no longer used'",
                model[:128],
            )
        self.trust.pop(model, None)
        return False

    # -- the request path -------------------------------------------------------------------------
    def segments(self, model: str, messages: Sequence[Any] | None, prompt: str | None) -> Segments | None:
        if not self.enabled:
            return None
        try:
            if messages is not None:
                return chat_segments(model, messages) if messages else None
            if prompt is not None:
                return prompt_segments(model, prompt)
        except Exception as exc:  # a message orjson cannot write (a >64-bit integer): no cache for it
            log.debug("event=token_cache_skipped error=%r", exc)
        return None

    async def resolve(
        self,
        tokenize: TokenizeFn,
        model: str,
        messages: Sequence[Any] | None,
        prompt: str | None,
        root: int,
        timeout_s: float,
    ) -> Tokens | None:
        """Token ids of a chat or completions text prompt: an exact entry, else a trusted cached prefix that
        covers ``min_fraction`` of the prompt, else ``tokenize`` on the request path within ``timeout_s``
        (TimeoutError propagates when there is no cached prefix to fall back on). Fills are scheduled."""
        seg = self.segments(model, messages, prompt)
        if seg is None:
            self._count("lookups", "miss")
            ids = await self._call(tokenize, model, messages, prompt, timeout_s)
            if ids is None:
                return None
            keys = _keys(ids, self.block_size, root, self.max_blocks)
            return Tokens(keys, len(ids), True, "miss")
        cache = self.cache
        exact = cache.get(seg.exact_key)
        if exact is not None:
            self._count("lookups", "exact")
            self._after(seg, None, root)
            return Tokens(cache.keys_of(seg.exact_key, exact, root, self.max_blocks), exact.tokens, True, "exact")
        j, prefix = self._longest(seg)
        if prefix is not None and self.trusted(model) and seg.sizes[j - 1] >= self.min_fraction * seg.total:
            return self._from_prefix(seg, j, prefix, root, "prefix")
        parent = seg.keys[j - 1] if prefix is not None else None
        try:
            ids = await self._call(tokenize, model, messages, prompt, timeout_s)
        except TimeoutError:
            ids = None
            if prefix is None or not self.trusted(model):
                self._count("lookups", "miss")
                self._after(seg, None, root)
                raise
        if ids is None:
            if prefix is not None and self.trusted(model):  # (still trusted after the wait)
                return self._from_prefix(seg, j, prefix, root, "prefix_after_failure")
            self._count("lookups", "miss")
            self._after(seg, None, root)
            return None
        self._count("lookups", "miss")
        packed = _pack(ids)
        self._check(model, parent, packed)  # the round trip confirms (or refutes) the cached prefix
        keys = _keys(ids, self.block_size, root, self.max_blocks)
        entry = Entry(packed, len(ids), seg.total, exact=True)
        cache.put(seg.exact_key, entry)
        if cache.peek(seg.exact_key) is entry:
            cache._memo(seg.exact_key, entry, root, keys)
        self._after(seg, None, root)
        return Tokens(keys, len(ids), True, "miss")

    def _from_prefix(self, seg: Segments, j: int, prefix: Entry, root: int, how: str) -> Tokens:
        """The answer from the prefix entry at point ``j`` (its keys; the prompt's tokens estimated)."""
        key = seg.keys[j - 1]
        self.cache.get(key)  # now the most recently used
        self._count("lookups", how)
        self._after(seg, j, root)
        keys = self.cache.keys_of(key, prefix, root, self.max_blocks)
        return Tokens(keys, _estimate(prefix, seg.total - seg.sizes[j - 1]), False, how)

    async def _call(
        self,
        tokenize: TokenizeFn,
        model: str,
        messages: Sequence[Any] | None,
        prompt: str | None,
        timeout_s: float,
    ) -> list[int] | None:
        self._count("round_trips", "request")
        async with asyncio.timeout(timeout_s):
            result: list[int] | None = await tokenize(model, messages=messages, prompt=prompt)
        return result

    def _longest(self, seg: Segments) -> tuple[int, Entry | None]:
        """The longest point with a prefix entry: (j, entry), or (0, None)."""
        peek = self.cache.peek
        for j in range(len(seg.keys), 0, -1):
            e = peek(seg.keys[j - 1])
            if e is not None and not e.exact:
                return j, e
        return 0, None

    def _after(self, seg: Segments, used: int | None, root: int, fill_parent: bool = True) -> None:
        """After a lookup: schedule the fills a later request needs and mark the request's points seen.

        Chat: the request's whole message list (the next turn begins with it). Both kinds: the longest point
        a request reached before (a marker) that has no entry yet and lies beyond the entry used, i.e. a
        prefix seen twice. The fill checks the entry the request used (when ``fill_parent``)."""
        cache = self.cache
        parent = seg.keys[used - 1] if used and fill_parent else None
        n = len(seg.keys)
        if seg.kind == "chat" and n and seg.keys[n - 1] not in cache:
            self._schedule(seg, n, root, parent)
            parent = None  # one check per request
        longest = used or 0
        for j in range(n - (1 if seg.kind == "chat" else 0), longest, -1):
            key = seg.keys[j - 1]
            if cache.seen(key):
                if key not in cache:
                    self._schedule(seg, j, root, parent)
                break
        for key in seg.keys:
            cache.mark(key)

    def _schedule(self, seg: Segments, j: int, root: int, parent: bytes | None) -> None:
        key = seg.keys[j - 1]
        if key in self.pending or seg.model in self.refused:
            return
        size = seg.sizes[j - 1]
        if self._queue.qsize() >= self.queue_size or self.queued_bytes + size > self.queue_max_bytes:
            self._count("fills", "dropped")
            return
        if seg.kind == "chat":
            assert seg.messages is not None
            fill = Fill(key, seg.model, tuple(seg.messages[:j]), None, size, root, parent)
        else:
            assert seg.prompt is not None
            fill = Fill(key, seg.model, None, seg.prompt[: seg.cuts[j - 1]], size, root, parent)
        self.pending.add(key)
        self.queued_bytes += size
        self._queue.put_nowait(fill)

    # -- background -------------------------------------------------------------------------------
    async def run_fills(self, source: Callable[[], Any], workers: int) -> None:
        """Run ``workers`` fill workers until cancelled; ``source()`` gives the tokenizer source to call."""
        async with asyncio.TaskGroup() as group:
            for i in range(workers):
                group.create_task(self._fill_worker(source), name=f"kv-token-fill-{i}")

    async def drained(self) -> None:
        """Wait until every scheduled fill has finished (tests, benchmarks)."""
        await self._queue.join()

    async def _fill_worker(self, source: Callable[[], Any]) -> None:
        while True:
            fill = await self._queue.get()
            self.queued_bytes -= fill.size
            try:
                await self._fill(source(), fill)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a fill never takes the workers down
                log.warning("event=token_cache_fill_failed error=%r", exc)
                self._count("fills", "failed")
            finally:
                self.pending.discard(fill.key)
                self._queue.task_done()

    async def _fill(self, src: Any, fill: Fill) -> None:
        self._count("round_trips", "background")
        try:
            async with asyncio.timeout(self.fill_timeout_s):
                if fill.messages is not None:
                    ids = await src.token_ids(fill.model, messages=fill.messages, add_generation_prompt=False)
                else:
                    ids = await src.token_ids(fill.model, prompt=fill.prompt)
        except TimeoutError:
            ids = None
        if ids is None:
            self._count("fills", "failed")
            return
        packed = _pack(ids[: min(safe_length(len(ids), self.block_size), self.cache.max_tokens)])
        if not self._check(fill.model, fill.parent, packed) or fill.model in self.refused:
            self._count("fills", "refused")
            return
        entry = Entry(packed, len(ids), fill.size, exact=False)
        # block keys for the triggering request's root, from the parent's memo when it is a prefix
        keys = await self._keys_for(entry, fill.root, fill.parent)
        self.cache.put(fill.key, entry)
        if self.cache.peek(fill.key) is entry:
            self.cache._memo(fill.key, entry, fill.root, keys)
        self._count("fills", "stored")

    async def _keys_for(self, entry: Entry, root: int, parent_key: bytes | None) -> array[int]:
        bs = self.block_size
        n = min(len(entry.packed) // (4 * bs), self.max_blocks)
        keys = array("Q")
        parent = self.cache.peek(parent_key) if parent_key is not None else None
        if parent is not None and parent.keys is not None and parent.keys_root == root:
            k = min(len(parent.keys), n)
            if entry.packed[: k * bs * 4] == parent.packed[: k * bs * 4]:
                keys.extend(parent.keys[:k])
        last = keys[-1] if keys else root
        i = len(keys)
        while i < n:
            stop = min(n, i + KEY_SLICE_BLOCKS)
            new = chain_packed_keys(entry.packed[i * bs * 4 : stop * bs * 4], bs, last)
            keys.extend(new)
            last = new[-1]
            i = stop
            if i < n:
                await asyncio.sleep(0)  # long prompts: let requests run between slices
        return keys


def _pack(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


def _keys(ids: Sequence[int], block_size: int, root: int, max_blocks: int) -> array[int]:
    n = min(len(ids) // block_size, max_blocks)
    return array("Q", chain_packed_keys(_pack(ids[: n * block_size]), block_size, root))


def _estimate(prefix: Entry, rest_bytes: int) -> int:
    """The prompt's tokens: the prefix's whole rendering, plus the rest at the prefix's tokens per byte."""
    if prefix.size <= 0:
        return prefix.tokens
    return prefix.tokens + round(prefix.tokens * rest_bytes / prefix.size)
