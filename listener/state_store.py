"""Restart-proof listener state: the persister that hands each source its saved state at start, writes the
state file periodically and at stop, and follows the set of sources as discovery changes it. The log it saves is
``listener.state_log``, the file ``listener.state_file``. See docs/listener.md#restart-proof-state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from listener.config import StateConfig
from listener.state_file import SourceState, read_state_file, remove_stale_tmp_files, write_state_file
from listener.state_log import Compacted, EventLog, compact

log = logging.getLogger("kv_listener.state")


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
