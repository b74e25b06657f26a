"""Restart-proof listener state: per ZMQ source, a compacted log of the engine's own events, the last
applied seq and a digest of that batch, in one file written atomically.

Why raw engine events and not the tracker's internals: replaying the engine's own events through the
decoder and the tracker rebuilds exactly what they would build now, whatever their internals (key
derivation, refcounts, limits) have become since the file was written; the file depends on the wire
format only (WIRE.md §3), which the engines own and which does not change under a listener upgrade.

The log is compacted by copy accounting (refcounts, as vLLM means them: a hash stored twice is two
copies, each removed separately, per medium and KV-cache group): a ``BlockStored`` event is kept while
it holds a live copy or is an ancestor (through ``parent_block_hash``) of a kept one; a removal is kept
for the copies it removed from kept stores, at its original position (so a parent removed after its
child was stored still keys the child on replay, as it did live). ``AllBlocksCleared`` empties the log.
So the log is bounded by the engine's live blocks plus their removed ancestors; a file larger than
``state.max_bytes`` is not written whole: a source that does not fit is saved without its log and
restored empty (counted, logged).

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

from listener.config import LimitsConfig, StateConfig
from listener.events import DecodeError
from listener.msgpack_decoder import decode_batch

log = logging.getLogger("kv_listener.state")

VERSION = 1
_TMP_IDS = itertools.count()
_TMP_MIDDLE = re.compile(r"[0-9]+\.[0-9]+")  # path.<pid>.<n>.tmp
_GPU = frozenset({None, "GPU", "gpu", "cuda", "CUDA"})
_STORED, _REMOVED = "S", "R"


def payload_digest(payload: bytes) -> bytes:
    """A stable digest of one batch payload (Python's hash() changes between processes)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def _fields(ev: Any) -> tuple[str | None, Any, Any, Any, Any]:
    """(tag, block_hashes, parent, medium, group_idx) of one raw wire event, array or map form."""
    if isinstance(ev, dict):
        return (
            ev.get("type"),
            ev.get("block_hashes"),
            ev.get("parent_block_hash"),
            ev.get("medium"),
            ev.get("group_idx"),
        )
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        tag = ev[0]
        if tag == "BlockStored":
            return (
                tag,
                ev[1] if len(ev) > 1 else None,
                ev[2] if len(ev) > 2 else None,
                ev[6] if len(ev) > 6 else None,
                None,
            )
        if tag == "BlockRemoved":
            return tag, ev[1] if len(ev) > 1 else None, None, ev[2] if len(ev) > 2 else None, None
        return tag, None, None, None, None
    return None, None, None, None, None


def _hashable(h: Any) -> bool:
    return isinstance(h, (int, bytes)) and not isinstance(h, bool)


def _medium(m: Any) -> Any:
    return "GPU" if m in _GPU else m


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


@dataclass(slots=True)
class Compacted:
    events: list[bytes]
    kept: set[int] = field(default_factory=set)
    size: int = 0


class EventLog:
    """The compacted event log of one source (see the module docstring). ``record`` runs on the loop per
    applied batch and costs O(events + blocks) of that batch.

    Memory bound: at most ``max_entries`` entries (garbage is dropped after each save); past it the log
    gives up (``overflow``: saved without events, restored empty) until the source is next cleared."""

    def __init__(self, max_entries: int = 1 << 22) -> None:
        self.max_entries = max_entries
        self.overflow = False
        self.version = 0  # bumped by every change (a save with nothing new is skipped)
        self.reset()

    def reset(self) -> None:
        self.version += 1
        self.overflow = False
        # id → ("S", packed event, parent store id | None) or ("R", medium, group, ((hash, store id), ...))
        self._entries: dict[int, tuple[Any, ...]] = {}
        self._live: dict[int, int] = {}  # store id → copies it still holds
        self._holders: dict[tuple[Any, Any, Any], list[int]] = {}  # (hash, medium, group) → store ids, LIFO
        self._by_hash: dict[Any, int] = {}  # hash → latest store id that stored it (ancestry)
        self._next = 0
        self._kept_after_gc = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, payload: bytes) -> None:
        """Account one applied batch given as its payload (decoded within the decoder's default limits)."""
        try:
            batch = decode_batch(payload, "vllm", LimitsConfig().max_event_tokens)
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

    def _record_event(self, ev: Any) -> None:
        tag, hashes, parent, medium, group = _fields(ev)
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
        med = _medium(medium)
        if tag == "BlockStored":
            parent_id = None if parent is None else self._by_hash.get(parent)
            self._entries[eid] = (_STORED, msgpack.packb(ev, use_bin_type=True), parent_id)
            for h in hashes:
                self._holders.setdefault((h, med, group), []).append(eid)
                self._by_hash[h] = eid
            self._live[eid] = len(hashes)
            return
        removed: list[tuple[Any, int]] = []
        for h in hashes:
            stack = self._holders.get((h, med, group))
            if not stack:
                continue  # unknown copy (the tracker counts it): nothing to replay
            sid = stack.pop()
            if not stack:
                del self._holders[(h, med, group)]
            self._live[sid] -= 1
            removed.append((h, sid))
        if removed:
            self._entries[eid] = (_REMOVED, medium, group, tuple(removed))

    def view(self) -> LogView:
        return LogView(dict(self._entries), dict(self._live), self._next)

    def gc(self, done: Compacted, upto: int) -> None:
        """Drop entries up to ``upto`` that the compaction did not keep (on the loop, after compact)."""
        if len(self._entries) < 2 * max(self._kept_after_gc, 1024):
            return
        self._entries = {k: v for k, v in self._entries.items() if k >= upto or k in done.kept}
        self._live = {k: v for k, v in self._live.items() if k in self._entries}
        self._by_hash = {h: i for h, i in self._by_hash.items() if i in self._entries}
        self._kept_after_gc = len(self._entries)


def compact(view: LogView) -> Compacted:
    """The events to replay, in order (pure: runs in a worker thread)."""
    entries = view.entries
    keep = {i for i, n in view.live.items() if n > 0 and i in entries}
    stack = list(keep)
    while stack:
        parent = entries[stack.pop()][2]
        if parent is not None and parent not in keep and parent in entries:
            keep.add(parent)
            stack.append(parent)
    out = Compacted([])
    for i, e in entries.items():
        if e[0] == _STORED:
            if i in keep:
                out.events.append(e[1])
                out.size += len(e[1])
            continue
        hashes = [h for h, sid in e[3] if sid in keep]
        if hashes:
            ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": e[1]}
            if e[2] is not None:
                ev["group_idx"] = e[2]
            packed = msgpack.packb(ev, use_bin_type=True)
            out.events.append(packed)
            out.size += len(packed)
            out.kept.add(i)
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
    run in a worker thread."""

    def __init__(self, cfg: StateConfig, sources: list[PersistedSource], on_result: Any = None) -> None:
        assert cfg.path is not None
        self.cfg = cfg
        self.path: str = cfg.path
        self.sources = sources
        self.on_result = on_result or (lambda result, size: None)
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
        saved = await asyncio.to_thread(read_state_file, self.path, self.cfg.max_bytes)
        n = 0
        for src in self.sources:
            st = saved.get(src.name)
            if st is None:
                continue
            if st.overflow:
                log.warning("event=state_not_restored source=%s reason=overflow", src.name)
                continue
            if st.fingerprint != src.fingerprint():
                log.warning("event=state_not_restored source=%s reason=other_engine", src.name)
                continue
            src.restore(st)
            n += 1
        return n

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
            stamp = [(src.log.version, *src.persisted()[:2]) for src in self.sources]
            if stamp == self._last_stamp:
                return  # nothing applied since the last write
            views = [(src, src.log.view(), *src.persisted()) for src in self.sources]
            overflowed_logs = {src.name for src in self.sources if src.log.overflow}

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
