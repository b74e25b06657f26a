"""The compacted event log of one ZMQ source: the engine's own events that rebuild its tracker after a restart
(what the state file holds per source), accounted by copies so it stays bounded by the engine's live blocks, and
``compact``, which picks the events to replay and their order. See docs/listener.md#the-event-log-and-compaction.

One cohesive thing over ~330 lines: the copy accounting mirrors the tracker's presence rules
(``listener.block_chains``), and ``compact`` reads exactly what that accounting records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from listener.config import LimitsConfig
from listener.events import DecodeError, medium_label
from listener.msgpack_decoder import MAX_GROUPS, decode_batch

log = logging.getLogger("kv_listener.state")

_GPU = medium_label(None)
_DROP_GROUP = MAX_GROUPS - 1  # group of the synthetic removal that replays a drop of offload copies only
_STORED, _REMOVED = "S", "R"


def _fields(ev: Any) -> tuple[str | None, Any, Any, Any, Any, Any, Any]:
    """(tag, block_hashes, parent, medium, group_idx, token_ids, block_size) of one raw wire event, array or
    map form."""
    if isinstance(ev, dict):
        return (
            ev.get("type"),
            ev.get("block_hashes"),
            ev.get("parent_block_hash"),
            ev.get("medium"),
            ev.get("group_idx"),
            ev.get("token_ids"),
            ev.get("block_size"),
        )
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        tag = ev[0]
        if tag == "BlockStored":
            at = [ev[i] if len(ev) > i else None for i in range(1, 7)]  # hashes, parent, tokens, size, lora, medium
            return tag, at[0], at[1], at[5], None, at[2], at[3]
        if tag == "BlockRemoved":
            return tag, ev[1] if len(ev) > 1 else None, None, ev[2] if len(ev) > 2 else None, None, None, None
        return tag, None, None, None, None, None, None
    return None, None, None, None, None, None, None


def _hashable(h: Any) -> bool:
    return isinstance(h, (int, bytes)) and not isinstance(h, bool)


def batch_payload(events: Iterable[bytes]) -> bytes:
    """A ``[ts, events]`` batch payload from already-packed events (for replaying a log). The smallest
    batch the decoder accepts (2 containers, 2 + len(events) elements besides the events' own): an event
    that passed the decoder's budget in any live batch passes it alone in this one."""
    evs = list(events)
    packer = msgpack.Packer(use_bin_type=True)
    return b"".join([packer.pack_array_header(2), packer.pack(0), packer.pack_array_header(len(evs)), *evs])


@dataclass(slots=True)
class LogView:
    """A frozen copy of an EventLog (cheap dict copies on the loop), compacted off the loop."""

    entries: dict[int, tuple[Any, ...]]
    live: dict[int, int]
    last_id: int
    born: dict[Any, int] = field(default_factory=dict)  # hash of a node present now → the store that created it
    keyers: list[int] = field(default_factory=list)  # stores that keyed a present node created unkeyed


@dataclass(slots=True)
class Compacted:
    events: list[bytes]
    kept: set[int] = field(default_factory=set)
    size: int = 0


class EventLog:
    """The compacted event log of one source. ``record`` runs on the loop per applied batch and costs
    O(events + blocks) of that batch. It mirrors the tracker's presence rules; at most ``max_entries`` entries
    (past it ``overflow``: saved without events until the next clear). See
    docs/listener.md#the-event-log-and-compaction."""

    def __init__(
        self, max_entries: int = 1 << 22, treat_eviction_as_offload: bool = False, engine: str = "vllm"
    ) -> None:
        self.max_entries = max_entries
        self.treat_eviction_as_offload = treat_eviction_as_offload
        self.engine = engine
        self.overflow = False
        self.version = 0  # bumped by every change (a save with nothing new is skipped)
        self.reset()

    def reset(self) -> None:
        self.version += 1
        self.overflow = False
        # id → ("S", packed event, ((hash, (creator id, keyer id | None, holder ids)), ...) it depends on) or
        #      ("R", medium, group, ((hash, store id popped), ...), ((hash, store id of a dropped offload copy), ...))
        self._entries: dict[int, tuple[Any, ...]] = {}
        self._live: dict[int, int] = {}  # store id → copies it still holds (offload copies included)
        self._holders: dict[tuple[Any, str, int], list[int]] = {}  # (hash, medium, group) → store ids, LIFO
        self._slots: dict[Any, set[tuple[str, int]]] = {}  # hash → its (medium, group) with a copy
        self._offload: dict[Any, dict[int, int]] = {}  # hash → group → store id holding its offload copy
        self._born: dict[Any, int] = {}  # hash of a present node → the store that created it
        self._anchored: dict[Any, bool] = {}  # hash of a present node → keyed through its chain (as far as known)
        self._keyer: dict[Any, int] = {}  # hash of a present node created unkeyed → the store that keyed it
        self._next = 0
        self._kept_after_gc = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, payload: bytes) -> None:
        """Account one applied batch given as its payload (decoded within the decoder's default limits)."""
        try:
            batch = decode_batch(payload, self.engine, LimitsConfig().max_event_tokens)
        except DecodeError:  # the decoder refuses it too: nothing was applied
            self.version += 1
            return
        self.record_events(batch.raw_events)

    def record_events(self, events: list[Any]) -> None:
        """Account one applied batch: the undecoded events the decoder accepted (``DecodedBatch.raw_events``),
        so a payload is unpacked once, within the decoder's limits."""
        self.version += 1
        if self.overflow:  # only an AllBlocksCleared brings the log back: what follows it is all there is
            clears = [i for i, ev in enumerate(events) if _fields(ev)[0] == "AllBlocksCleared"]
            if not clears:
                return
            events = events[clears[-1] :]
        for ev in events:
            self._record_event(ev)
        if len(self._entries) > self.max_entries:
            log.warning("event=state_log_overflow entries=%d action=not_persisted_until_clear", len(self._entries))
            self.reset()
            self.overflow = True

    # -- presence, as the tracker sees it ------------------------------------------------------------------
    def _present(self, h: Any) -> bool:
        return h in self._slots or h in self._offload

    def _deps(self, h: Any, into: dict[Any, tuple[int, int | None, tuple[int, ...]]]) -> None:
        """What a store touching present node ``h`` needs before it on replay: the store that created the
        node and the one that keyed it (its keys), and, should that node's life end before the compaction,
        one that holds a copy of it now (the node exists at that point of the replay)."""
        slots = self._slots.get(h)
        if slots:
            medium, group = next(iter(slots))
            holders: tuple[int, ...] = (self._holders[(h, medium, group)][0],)
        else:
            holders = tuple(self._offload[h].values())
        into[h] = (self._born[h], self._keyer.get(h), holders)

    def _add_copy(self, h: Any, medium: str, group: int, sid: int) -> None:
        self._holders.setdefault((h, medium, group), []).append(sid)
        self._slots.setdefault(h, set()).add((medium, group))

    def _pop_copy(self, h: Any, medium: str, group: int) -> int | None:
        stack = self._holders.get((h, medium, group))
        if not stack:
            return None
        sid = stack.pop()
        if not stack:
            del self._holders[(h, medium, group)]
            slots = self._slots[h]
            slots.discard((medium, group))
            if not slots:
                del self._slots[h]
        self._live[sid] -= 1
        return sid

    def _page_ok(self, n: int, tokens: Any, block_size: Any) -> bool:
        ntok = len(tokens) if isinstance(tokens, list) else 0
        if isinstance(block_size, int) and block_size > 0 and ntok == n * block_size:
            return True
        return self.engine == "sglang" and n == 1 and isinstance(block_size, int) and 0 < ntok < block_size

    def _record_event(self, ev: Any) -> None:
        tag, hashes, parent, medium, group, tokens, block_size = _fields(ev)
        if tag == "AllBlocksCleared":
            self.reset()
            return
        if tag not in ("BlockStored", "BlockRemoved") or not isinstance(hashes, list):
            return
        if not all(_hashable(h) for h in hashes) or (parent is not None and not _hashable(parent)):
            return
        if not isinstance(group, (int, type(None))) or not isinstance(medium, (str, type(None))):
            return
        eid = self._next
        self._next += 1
        med = medium_label(medium)
        g = group or 0
        if tag == "BlockStored":
            self._record_store(eid, ev, hashes, parent, med, g, tokens, block_size)
        else:
            self._record_removal(eid, hashes, medium, group, med, g)

    def _record_store(
        self, eid: int, ev: Any, hashes: list[Any], parent: Any, med: str, g: int, tokens: Any, block_size: Any
    ) -> None:
        placeholder = block_size == 0 and not tokens  # vLLM CPU offloading: a copy of a node that exists
        fits = placeholder or self._page_ok(len(hashes), tokens, block_size)
        deps: dict[Any, tuple[int, int | None, tuple[int, ...]]] = {}
        chained = parent is None  # the page before is keyed (the tracker's anchor), as far as presence tells
        if not placeholder and parent is not None and self._present(parent):
            self._deps(parent, deps)
            chained = self._anchored[parent]
        chained = chained and not placeholder and block_size != 0 and fits
        copies = 0
        for h in hashes:
            if self._present(h):
                if not fits:
                    continue  # the tracker never changes a known node with a store that fails the page check
                self._deps(h, deps)
                if chained and not placeholder and not self._anchored[h]:  # the tracker keys it now
                    self._anchored[h] = True
                    self._keyer[h] = eid
            elif placeholder:
                continue  # the tracker ignores a placeholder of an unknown hash
            else:
                self._born[h] = eid
                self._anchored[h] = chained
            self._add_copy(h, med, g, eid)
            copies += 1
            chained = self._anchored[h]
        if copies:
            self._entries[eid] = (_STORED, msgpack.packb(ev, use_bin_type=True), tuple(deps.items()))
            self._live[eid] = copies

    def _record_removal(self, eid: int, hashes: list[Any], medium: Any, group: Any, med: str, g: int) -> None:
        pops: list[tuple[Any, int]] = []
        drops: list[tuple[Any, int]] = []
        for h in hashes:
            if not self._present(h):
                continue  # unknown to the tracker too: nothing to replay
            had = len(self._holders.get((h, med, g), ()))
            sid = self._pop_copy(h, med, g)
            if sid is not None:
                pops.append((h, sid))
            if med == _GPU:
                if sid is not None and had == 1 and self.treat_eviction_as_offload:
                    held = self._offload.setdefault(h, {})
                    if g not in held:  # the tracker's offload copy: the popped store stays live for it
                        held[g] = sid
                        self._live[sid] += 1
            else:
                for osid in self._offload.pop(h, {}).values():  # any other removal drops the offload copies
                    self._live[osid] -= 1
                    drops.append((h, osid))
            if not self._present(h):
                del self._born[h], self._anchored[h]
                self._keyer.pop(h, None)
        if pops or drops:
            self._entries[eid] = (_REMOVED, medium, group, tuple(pops), tuple(drops))

    def view(self) -> LogView:
        return LogView(dict(self._entries), dict(self._live), self._next, dict(self._born), list(self._keyer.values()))

    def gc(self, done: Compacted, upto: int) -> None:
        """Drop entries up to ``upto`` that the compaction did not keep (on the loop, after compact)."""
        if len(self._entries) < 2 * max(self._kept_after_gc, 1024):
            return
        self._entries = {k: v for k, v in self._entries.items() if k >= upto or k in done.kept}
        self._live = {k: v for k, v in self._live.items() if k in self._entries}
        self._kept_after_gc = len(self._entries)


def _removal(hashes: list[Any], medium: Any, group: Any) -> bytes:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group is not None:
        ev["group_idx"] = group
    return msgpack.packb(ev, use_bin_type=True)


def compact(view: LogView) -> Compacted:
    """The events to replay, in order (pure: runs in a worker thread). What is kept, how a removal is replayed
    and why the removals of present nodes go last: docs/listener.md#the-event-log-and-compaction."""
    entries, born = view.entries, view.born
    keep = {i for i, n in view.live.items() if n > 0 and i in entries}
    keep.update(i for i in born.values() if i in entries)
    keep.update(i for i in view.keyers if i in entries)
    stack = list(keep)
    while stack:
        entry = entries[stack.pop()]
        if entry[0] != _STORED:
            continue
        for h, (created, keyer, holders) in entry[2]:
            # a node present now with the same creator is the same node: its replayed removals come last,
            # so it exists at any later point of the replay without another holder
            needed = (created, keyer) if born.get(h) == created else (created, keyer, *holders)
            for dep in needed:
                if dep is not None and dep not in keep and dep in entries:
                    keep.add(dep)
                    stack.append(dep)
    out = Compacted([])
    tail: list[bytes] = []

    def emit(into: list[bytes], packed: bytes) -> None:
        into.append(packed)
        out.size += len(packed)

    for i, e in entries.items():
        if e[0] == _STORED:
            if i in keep:
                emit(out.events, e[1])
            continue
        _, medium, group, pops, drops = e
        now: tuple[list[Any], list[Any]] = ([], [])  # (removals, offload drops) at this position
        late: tuple[list[Any], list[Any]] = ([], [])  # ... at the end
        done: set[Any] = set()  # hashes whose offload copies this replayed entry drops already
        for h, sid in pops:
            if sid in keep:
                done.add(h)
                (late if born.get(h, i) < i else now)[0].append(h)
        for h, sid in drops:
            if sid in keep and h not in done:
                done.add(h)
                (late if born.get(h, i) < i else now)[1].append(h)
        for into, (removed, dropped) in ((out.events, now), (tail, late)):
            if removed:
                emit(into, _removal(removed, medium, group))
            if dropped:
                emit(into, _removal(dropped, "CPU", _DROP_GROUP))
        if done:
            out.kept.add(i)
    out.events.extend(tail)
    out.kept |= keep
    return out
