"""listener.state_store: the persister hands each source its saved state (same name and fingerprint), writes
the file periodically and at stop, one write at a time, and follows the set of sources. Over real ZMQ sockets:
the listener restarted while an engine keeps publishing resumes exactly (its feed state equals that of a
listener that never restarted), an engine that restarted while the listener was down has its old incarnation
cleared before any of its new blocks count, and an unverifiable incarnation is never restored (issue 8).

The tests that start a server or bind a socket: tests/integration/test_listener_state_store.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from listener import state_store
from listener.app import ListenerApp
from listener.config import ListenerConfig, StateConfig
from listener.state_file import SourceState, read_state_file, write_state_file
from listener.state_log import EventLog, compact
from listener.state_store import StatePersister
from listener.zmq_source import ZmqEventSource
from tests.support.listener_apps import BS
from tests.support.listener_events import Live, random_workload, src_cfg


# -- the persister --------------------------------------------------------------------------------------------
class _Counting(concurrent.futures.ThreadPoolExecutor):
    submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        type(self).submitted += 1
        return super().submit(*args, **kwargs)


class _Src:
    """The least a persister needs of a source."""

    def __init__(self, name: str = "e1", fingerprint: str = "f") -> None:
        self.name = name
        self._fingerprint = fingerprint
        self.restored: SourceState | None = None
        self.log = EventLog()
        self.seq = 1

    def fingerprint(self) -> str:
        return self._fingerprint

    def persisted(self) -> tuple[int | None, bytes | None, list[bytes] | None]:
        return self.seq, b"d", None

    def restore(self, state: SourceState) -> None:
        self.restored = state


async def test_final_save_waits_for_the_write_of_a_cancelled_periodic_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    executor = _Counting(max_workers=4)
    _Counting.submitted = 0
    loop.set_default_executor(executor)
    release = threading.Event()
    entered: asyncio.Future[None] = loop.create_future()
    real_write = state_store.write_state_file
    calls = 0

    def blocking_write(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            loop.call_soon_threadsafe(entered.set_result, None)
            release.wait()
        return real_write(*args)

    monkeypatch.setattr(state_store, "write_state_file", blocking_write)
    src = _Src()
    persister = StatePersister(StateConfig(path=str(tmp_path / "state.bin")), [src])  # type: ignore[list-item]
    try:
        periodic = asyncio.create_task(persister.save())
        await entered
        periodic.cancel()  # the supervisor stops persister.run(): its write thread goes on
        with pytest.raises(asyncio.CancelledError):
            await periodic
        src.seq = 2
        final = asyncio.create_task(persister.save())
        for _ in range(10):
            await asyncio.sleep(0)  # turns of the loop (not a timed wait): the final save runs up to its await
        second_writer = _Counting.submitted > 1
    finally:
        release.set()
    await final
    assert not second_writer, "a second writer started while the first still wrote"
    assert calls == 2
    assert read_state_file(str(tmp_path / "state.bin"), 1 << 20)["e1"].last_seq == 2


def test_tmp_files_of_unfinished_writes_are_removed_at_start(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    for name in ("state.bin.tmp", "state.bin.123.4.tmp", "state.bin.x.tmp", "other.bin.1.2.tmp", "state.bin"):
        (tmp_path / name).write_bytes(b"")
    persister = StatePersister(StateConfig(path=str(path)), [])
    assert asyncio.run(persister.restore()) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.bin.1.2.tmp", "state.bin", "state.bin.x.tmp"]


async def test_saved_states_go_to_their_sources_and_follow_the_source_set(tmp_path: Path) -> None:
    """Matched by name and fingerprint; an overflowed one is not handed over; a source added later gets its state;
    states nobody claimed are written back until forget_unclaimed; a removed source is no longer written."""
    path = str(tmp_path / "state.bin")
    saved = {
        "same": SourceState("f", 5, b"d", [b"e"]),
        "other-engine": SourceState("g", 6, b"d", []),
        "overflowed": SourceState("f", 7, b"d", [], overflow=True),
        "late": SourceState("f", 8, b"d", []),
        "gone": SourceState("f", 9, b"d", []),
    }
    write_state_file(path, saved, 1 << 20)
    results: list[tuple[str, int]] = []
    srcs = [_Src("same"), _Src("other-engine"), _Src("overflowed"), _Src("new")]
    persister = StatePersister(
        StateConfig(path=path),
        srcs,
        lambda result, size: results.append((result, size)),  # type: ignore[list-item]
    )
    assert await persister.restore() == 1
    assert [s.restored for s in srcs] == [saved["same"], None, None, None]
    late = _Src("late")
    assert persister.add(late) and late.restored == saved["late"]  # type: ignore[arg-type]
    await persister.save()
    assert sorted(read_state_file(path, 1 << 20)) == ["gone", "late", "new", "other-engine", "overflowed", "same"]
    assert results[-1][0] == "ok" and results[-1][1] > 0
    assert persister.forget_unclaimed() == ["gone"]
    persister.remove("other-engine")
    await persister.save()
    assert sorted(read_state_file(path, 1 << 20)) == ["late", "new", "overflowed", "same"]
    saves = len(results)
    await persister.save()  # nothing applied since: no write
    assert len(results) == saves


async def test_a_failed_write_is_reported_and_the_next_save_writes(tmp_path: Path) -> None:
    results: list[str] = []
    persister = StatePersister(
        StateConfig(path=str(tmp_path / "missing-dir" / "state.bin")),
        [_Src()],  # type: ignore[list-item]
        lambda result, size: results.append(result),
    )
    await persister.save()
    assert results == ["failed"]
    (tmp_path / "missing-dir").mkdir()
    await persister.save()
    assert results == ["failed", "ok"]


async def test_listener_apps_restore_from_a_state_file(tmp_path: Path) -> None:
    """The whole path (persister, file, source) with placeholders and offload copies."""
    src = src_cfg(offload=True)
    cfg = ListenerConfig(
        listen="127.0.0.1:0", key_block_size=BS, sources=(src,), state=StateConfig(path=str(tmp_path / "s.bin"))
    )
    live = Live(offload=True)
    for batch in random_workload(random.Random(99), 200):
        live.apply(batch)
    events = compact(live.log.view()).events
    write_state_file(str(tmp_path / "s.bin"), {"e1": SourceState("x", 1, b"d", events)}, 1 << 30)
    st = read_state_file(str(tmp_path / "s.bin"), 1 << 30)["e1"]
    app = ListenerApp(cfg)
    zsrc = app.sources["e1"]
    assert isinstance(zsrc, ZmqEventSource)
    await zsrc._apply_restored(st)
    assert app.feeds["e1"].state and app.feeds["e1"].state == live.sink.state
