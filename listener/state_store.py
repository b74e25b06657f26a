"""Restart-proof listener state: per ZMQ source, a compacted log of the engine's own events, the last
applied seq and a digest of that batch, in one file written atomically.

Why raw engine events and not the tracker's internals: replaying the engine's own events through the
decoder and the tracker rebuilds exactly what they would build now, whatever their internals (key
derivation, refcounts, limits) have become since the file was written; the file depends on the wire
format only (docs/wire.md §3), which the engines own and which does not change under a listener upgrade.

The log is compacted by copy accounting (refcounts, as vLLM means them: a hash stored twice is two
copies, each removed separately, per medium and KV-cache group), mirroring the tracker's presence rules
(CPU placeholder stores, ``treat_eviction_as_offload`` copies): a ``BlockStored`` event is kept while it
holds a live copy, created a node that is present now, or is needed by a kept store (its parent's node,
or the node it adds a copy to, as it stood then); a removal is kept for the copies it removed from kept
stores (see ``compact`` for where it goes). ``AllBlocksCleared`` empties the log. So the log is bounded by
the engine's live blocks plus the stores they depend on; a file larger than ``state.max_bytes`` is not
written whole: a source that does not fit is saved without its log and restored empty (counted, logged).

File: msgpack ``{"version": 1, "sources": {name: {"fingerprint", "last_seq", "digest", "events",
"overflow"}}}``; written to a tmp file of its own (``path.<pid>.<n>.tmp``), fsynced, renamed over ``path``
(then the directory fsynced): a crash leaves the old or the new file, never a torn one. One write at a
time: a save waits for the write of a cancelled one (stop cancels the periodic save, then saves once
more). Tmp files left by a crash are removed at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from listener.block_chains import medium_label
from listener.config import LimitsConfig, StateConfig
from listener.events import DecodeError
from listener.msgpack_decoder import MAX_GROUPS, decode_batch

log = logging.getLogger("kv_listener.state")

VERSION = 1
_TMP_IDS = itertools.count()
_TMP_MIDDLE = re.compile(r"[0-9]+\.[0-9]+")  # path.<pid>.<n>.tmp
_GPU = medium_label(None)
_DROP_GROUP = MAX_GROUPS - 1  # group of the synthetic removal that replays a drop of offload copies only
_STORED, _REMOVED = "S", "R"


def payload_digest(payload: bytes) -> bytes:
    """A stable digest of one batch payload (Python's hash() changes between processes)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


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
    """The compacted event log of one source (see the module docstring). ``record`` runs on the loop per
    applied batch and costs O(events + blocks) of that batch.

    The log mirrors the tracker's presence rules (``block_chains``): a node exists while it holds a copy;
    a CPU placeholder store adds a copy to a node that exists (and is ignored otherwise); a store that fails
    the page check leaves an existing node alone; with ``treat_eviction_as_offload`` a GPU removal of the
    node's last GPU copy in a group adds a synthetic offload copy, which every non-GPU removal of the node
    drops. The store whose GPU copy became the offload copy stays live while that copy lasts.

    Memory bound: at most ``max_entries`` entries (garbage is dropped after each save); past it the log
    gives up (``overflow``: saved without events, restored empty) until the source is next cleared."""

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
    """The events to replay, in order (pure: runs in a worker thread).

    Kept: stores holding a live copy (an offload copy included), the store that created each present node,
    and, transitively, what a kept store depends on (its parent's creator and a holder of the parent at
    that time; for a copy of a present node, that node's creator and a holder). A removal is replayed for
    the copies it took from kept stores; a removal that only dropped offload copies of kept stores is
    replayed as a removal from a group that holds nothing (``_DROP_GROUP``), which drops them alike.

    Order: a removal of a node that is present now, made since the store that created it, is replayed at
    the end, after every kept store: the node then exists on replay from its creation on, as it did live
    (a removal in place could take the only replayed copy before a placeholder or a child that needs the
    node, while live another copy, not kept, still held it). Counted per (medium, group), the replayed
    removals take exactly the copies of the kept stores, so the copies at the end are those of now; the
    last GPU copy of a group goes last, so an offload copy appears (or not) as it did live. Every other
    removal stays at its original position (a parent removed before a child was stored leaves that child
    unkeyed on replay, as it did live)."""
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


@dataclass(slots=True)
class SourceState:
    """What one source persists (and gets back at start)."""

    fingerprint: str
    last_seq: int | None
    digest: bytes | None
    events: list[bytes]
    overflow: bool = False


def write_state_file(path: str, states: dict[str, SourceState], max_bytes: int) -> tuple[int, list[str]]:
    """Write atomically (tmp + fsync + rename); returns (bytes written, sources saved without their log).
    Blocking: call it in a worker thread."""
    budget = max_bytes - 4096
    doc: dict[str, Any] = {"version": VERSION, "sources": {}}
    overflowed: list[str] = []
    for name, st in states.items():
        size = sum(len(e) + 5 for e in st.events) + 256
        keep = size <= budget and not st.overflow
        if keep:
            budget -= size
        else:
            overflowed.append(name)
        doc["sources"][name] = {
            "fingerprint": st.fingerprint,
            "last_seq": st.last_seq,
            "digest": st.digest,
            "events": st.events if keep else [],
            "overflow": not keep,
        }
    data = msgpack.packb(doc, use_bin_type=True)
    tmp = f"{path}.{os.getpid()}.{next(_TMP_IDS)}.tmp"  # one file per write: two writers never share one
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return len(data), overflowed


def remove_stale_tmp_files(path: str) -> int:
    """Delete the tmp files of writes that never finished (a crash between open and rename); returns how
    many. Call it before the first write of this process."""
    folder, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    n = 0
    for name in names:
        middle = name[len(base) + 1 : -4] if name.startswith(base + ".") and name.endswith(".tmp") else None
        if middle is not None and (middle == "" or _TMP_MIDDLE.fullmatch(middle)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
                n += 1
    return n


def read_state_file(path: str, max_bytes: int) -> dict[str, SourceState]:
    """The saved sources, or {} when there is no usable file (missing, too large, unreadable: logged)."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            log.warning("event=state_ignored path=%s reason=too_large bytes=%d", path, size)
            return {}
        with open(path, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        return {}
    except Exception as exc:
        log.warning("event=state_ignored path=%s reason=unreadable error=%s", path, type(exc).__name__)
        return {}
    out: dict[str, SourceState] = {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("sources"), dict):
        log.warning("event=state_ignored path=%s reason=bad_format", path)
        return {}
    for name, s in doc["sources"].items():
        try:
            seq = s["last_seq"]
            events = s["events"]
            ok = (
                isinstance(name, str)
                and isinstance(s["fingerprint"], str)
                and (seq is None or (isinstance(seq, int) and 0 <= seq < 1 << 64))
                and (s["digest"] is None or isinstance(s["digest"], bytes))
                and isinstance(events, list)
                and all(isinstance(e, bytes) for e in events)
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("event=state_ignored path=%s source=%s reason=bad_format", path, name)
            continue
        out[name] = SourceState(s["fingerprint"], seq, s["digest"], events, bool(s.get("overflow")))
    return out


class PersistedSource(Protocol):
    """What the persister needs of a source (``ZmqEventSource``)."""

    name: str
    log: EventLog

    def fingerprint(self) -> str: ...

    def persisted(self) -> tuple[int | None, bytes | None, list[bytes] | None]: ...

    def restore(self, state: SourceState) -> None: ...


class StatePersister:
    """Restores sources at start, writes the state file every ``interval_seconds`` and at stop.

    On the loop per save: one dict copy per source (the log view); compaction, packing and the write
    run in a worker thread.

    The set of sources may change (discovery): ``add`` hands a new source the saved state of its name (same
    fingerprint) if the file had one, ``remove`` forgets a source (its state is not written again). Saved states
    no source has claimed yet are written back unchanged until ``forget_unclaimed`` (the listener calls it once
    it knows the pool: a backend not in it is gone); they are bounded by the file read (``state.max_bytes``)."""

    def __init__(self, cfg: StateConfig, sources: list[PersistedSource], on_result: Any = None) -> None:
        assert cfg.path is not None
        self.cfg = cfg
        self.path: str = cfg.path
        self.sources = list(sources)
        self.on_result = on_result or (lambda result, size: None)
        self._unclaimed: dict[str, SourceState] = {}  # read at restore(), not yet handed to a source
        self._restored = False
        self._lock = asyncio.Lock()
        self._last_stamp: list[Any] | None = None
        # the write of the last save: it runs on in its thread when that save is cancelled (the supervisor
        # stops run()); the next save waits for it, so one write at a time reaches the file, in order
        self._writing: asyncio.Future[Any] | None = None

    async def restore(self) -> int:
        """Hand each source its saved state (matched by name and fingerprint); returns how many."""
        stale = await asyncio.to_thread(remove_stale_tmp_files, self.path)
        if stale:
            log.warning("event=state_tmp_removed path=%s files=%d", self.path, stale)
        self._unclaimed = await asyncio.to_thread(read_state_file, self.path, self.cfg.max_bytes)
        self._restored = True
        return sum(self._hand_over(src) for src in self.sources)

    def _hand_over(self, src: PersistedSource) -> bool:
        st = self._unclaimed.pop(src.name, None)
        if st is None:
            return False
        if st.overflow:
            log.warning("event=state_not_restored source=%s reason=overflow", src.name)
            return False
        if st.fingerprint != src.fingerprint():
            log.warning("event=state_not_restored source=%s reason=other_engine", src.name)
            return False
        src.restore(st)
        return True

    def add(self, src: PersistedSource) -> bool:
        """Persist ``src`` from now on; True when it got saved state (call before the source runs)."""
        self.sources = [s for s in self.sources if s.name != src.name] + [src]
        return self._restored and self._hand_over(src)

    def remove(self, name: str) -> None:
        """Forget source ``name``: the next save leaves it out."""
        self.sources = [s for s in self.sources if s.name != name]
        self._unclaimed.pop(name, None)

    def forget_unclaimed(self) -> list[str]:
        """Drop the saved states no source claimed (their backends are gone); returns their names."""
        names = sorted(self._unclaimed)
        self._unclaimed = {}
        return names

    async def _settle(self) -> None:
        """Wait for the write of a cancelled save (its outcome was reported by nobody: it is dropped here)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            try:
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                self._writing = writing  # this save is cancelled too: the next one waits
                raise
            except Exception as exc:
                log.warning("event=state_save_failed path=%s error=%s", self.path, exc)

    async def save(self) -> None:
        async with self._lock:
            await self._settle()
            sources, unclaimed = list(self.sources), dict(self._unclaimed)
            stamp: list[tuple[Any, ...]] = [(src.name, src.log.version, *src.persisted()[:2]) for src in sources]
            stamp.append(tuple(sorted(unclaimed)))
            if stamp == self._last_stamp:
                return  # nothing applied since the last write
            views = [(src, src.log.view(), *src.persisted()) for src in sources]
            overflowed_logs = {src.name for src in sources if src.log.overflow}

            def work() -> tuple[int, list[str], list[Compacted]]:
                done = [compact(v) for _, v, _, _, _ in views]
                states = {
                    src.name: SourceState(
                        src.fingerprint(),
                        seq,
                        digest,
                        c.events if events is None else events,
                        overflow=events is None and src.name in overflowed_logs,
                    )
                    for (src, _, seq, digest, events), c in zip(views, done, strict=True)
                }
                for name, st in unclaimed.items():  # not yet claimed: written back as read
                    states.setdefault(name, st)
                size, overflowed = write_state_file(self.path, states, self.cfg.max_bytes)
                return size, overflowed, done

            writing = self._writing = asyncio.ensure_future(asyncio.to_thread(work))
            try:
                size, overflowed, done = await asyncio.shield(writing)
            except OSError as exc:
                self._writing = None
                log.warning("event=state_save_failed path=%s error=%s", self.path, exc)
                self.on_result("failed", 0)
                return
            self._writing = None
            self._last_stamp = stamp
            for (src, view, _, _, events), c in zip(views, done, strict=True):
                if events is None:
                    src.log.gc(c, view.last_id)
            for name in overflowed:
                log.warning(
                    "event=state_overflow source=%s max_bytes=%d action=saved_without_log", name, self.cfg.max_bytes
                )
            self.on_result("overflow" if overflowed else "ok", size)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_seconds)
            await self.save()
