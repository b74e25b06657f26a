"""Restart-proof state, review fixes: restore chunks within the decoder's budget, CPU placeholders and
``treat_eviction_as_offload`` copies survive compaction, one writer per state file at stop (the decoder's
salt fix is in test_engine_keys_decoder); and the state rebuilt from a compacted log equals the state of a
listener that never restarted, for a seeded random workload mixing every kind of copy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq.asyncio

from listener import state_file, state_store
from listener.app import ListenerApp
from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, ListenerConfig, SourceConfig, StateConfig
from listener.metrics import ListenerMetrics
from listener.msgpack_decoder import decode_batch
from listener.state_file import SourceState, read_state_file, write_state_file
from listener.state_log import EventLog, compact
from listener.state_store import StatePersister
from listener.zmq_source import ZmqEventSource
from tests.support.recording_sink import RecordingSink

KB = 16
MODEL = "m"


def src_cfg(offload: bool = False, engine: str = "vllm") -> SourceConfig:
    return SourceConfig(
        backend_name="e1",
        engine=engine,  # type: ignore[arg-type]
        model=MODEL,
        zmq_endpoint="tcp://127.0.0.1:1",
        treat_eviction_as_offload=offload,
    )


class Live:
    """A tracker fed the full stream, and the event log a listener with ``state.path`` keeps beside it."""

    def __init__(self, offload: bool = False, limits: LimitsConfig | None = None) -> None:
        self.limits = limits or LimitsConfig()
        self.cfg = src_cfg(offload)
        self.sink = RecordingSink()
        self.tracker = BlockChainTracker(self.cfg, self.limits, self.sink, key_block_size=KB)
        self.log = EventLog(treat_eviction_as_offload=offload)

    def apply(self, events: list[Any]) -> None:
        batch = decode_batch(msgpack.packb([0.0, events, 0]), "vllm", self.limits.max_event_tokens, self.limits)
        assert not batch.dropped
        self.tracker.apply_all(batch.events)
        self.log.record_events(batch.raw_events)

    def restored(self) -> Live:
        """A listener restarted from the compacted log (replayed through decoder, tracker and a new log)."""
        other = Live(self.cfg.treat_eviction_as_offload, self.limits)
        events = compact(self.log.view()).events
        if events:
            other.apply([msgpack.unpackb(e) for e in events])
        return other


def toks(tag: int, n: int = 1) -> list[int]:
    return [tag * 1000 + i for i in range(n * KB)]


def store(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": KB,
        "medium": medium,
    }


def placeholder(hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "medium": medium,
    }


def remove(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


# -- 1. restore chunks stay within the decoder's budget -------------------------------------------------------


def make_source(
    limits: LimitsConfig, ctx: zmq.asyncio.Context
) -> tuple[ZmqEventSource, RecordingSink, ListenerMetrics]:
    sink, metrics = RecordingSink(), ListenerMetrics()
    cfg = src_cfg()
    tracker = BlockChainTracker(cfg, limits, sink, key_block_size=KB)
    return ZmqEventSource(cfg, limits, tracker, metrics, ctx, keep_log=True), sink, metrics


def dropped(metrics: ListenerMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("kv_listener_events_dropped_total", {"source": "e1", "reason": reason})
    return value or 0.0


async def test_restore_chunks_fit_the_decoding_budget() -> None:
    """Each logged event passed the live budget alone; packed 512 to a payload they did not, and the whole
    chunk was skipped (then the next save persisted the loss)."""
    limits = LimitsConfig(max_message_items=4096, max_message_containers=4096)
    live = Live(limits=limits)
    for i in range(40):  # 16 blocks of 16 tokens each: ~300 items per event, 40 events ~12k items
        live.apply([store([i * 100 + k for k in range(16)], None, toks(i, 16))])
    events = compact(live.log.view()).events
    assert len(events) == 40
    ctx = zmq.asyncio.Context()
    try:
        src, sink, metrics = make_source(limits, ctx)
        await src._apply_restored(SourceState("f", 39, b"d", events))
    finally:
        ctx.destroy(linger=0)
    assert sink.state == live.sink.state and len(sink.state) == 40 * 16
    assert len(compact(src.log.view()).events) == 40  # the log rebuilt from the restored events is whole
    assert dropped(metrics, "too_large") == 0


async def test_a_restored_event_refused_anyway_is_counted_and_the_rest_restored() -> None:
    """Budgets lowered since the save: the one event that no longer fits is counted, its neighbours restored."""
    big = store(list(range(1000, 1064)), None, toks(1, 64))  # 64 blocks: ~1100 items
    small = [store([i], None, toks(10 + i)) for i in range(5)]
    events = [msgpack.packb(e) for e in [small[0], small[1], big, *small[2:]]]
    limits = LimitsConfig(max_message_items=1024)
    ctx = zmq.asyncio.Context()
    try:
        src, sink, metrics = make_source(limits, ctx)
        await src._apply_restored(SourceState("f", 9, b"d", events))
    finally:
        ctx.destroy(linger=0)
    assert len(sink.state) == 5
    assert dropped(metrics, "state_restore_refused") == 1


# -- 2. CPU placeholders ------------------------------------------------------------------------------------------


def test_placeholder_copy_survives_compaction_when_the_gpu_copy_goes() -> None:
    live = Live()
    live.apply([store([1, 2], None, toks(1, 2))])
    live.apply([placeholder([1, 2])])
    live.apply([remove([1, 2])])
    assert set(live.sink.state.values()) == {"storage_warm"} and len(live.sink.state) == 2
    assert live.restored().sink.state == live.sink.state


def test_child_stored_after_a_placeholder_is_keyed_after_restore() -> None:
    live = Live()
    live.apply([store([1], None, toks(1))])
    live.apply([placeholder([1])])
    live.apply([store([2], 1, toks(2))])  # its parent: the token-bearing store of 1, not the placeholder
    live.apply([remove([1])])
    assert len(live.sink.state) == 2
    assert live.restored().sink.state == live.sink.state


def test_placeholder_after_a_second_copy_was_removed() -> None:
    """Two GPU copies, the newer removed, then a placeholder, then the older removed: the CPU copy stays."""
    live = Live()
    live.apply([store([1], None, toks(1))])
    live.apply([store([1], None, toks(1))])
    live.apply([remove([1])])
    live.apply([placeholder([1])])
    live.apply([remove([1])])
    assert list(live.sink.state.values()) == ["storage_warm"]
    assert live.restored().sink.state == live.sink.state


# -- 3. treat_eviction_as_offload ---------------------------------------------------------------------------------


def test_offload_copy_survives_compaction() -> None:
    live = Live(offload=True)
    live.apply([store([1], None, toks(1))])
    live.apply([store([2], None, toks(2))])
    live.apply([remove([1])])
    assert sorted(live.sink.state.values()) == ["gpu_hot", "storage_warm"]
    assert live.restored().sink.state == live.sink.state


def test_offload_copy_dropped_by_a_cpu_removal_stays_dropped() -> None:
    live = Live(offload=True)
    live.apply([store([1, 2], None, toks(1, 2))])
    live.apply([remove([1])])
    live.apply([remove([1], "CPU")])  # no CPU copy: the tracker drops the synthetic one, the node goes
    assert list(live.sink.state.values()) == ["gpu_hot"]
    assert live.restored().sink.state == live.sink.state


def test_source_passes_treat_eviction_as_offload_to_its_log() -> None:
    ctx = zmq.asyncio.Context()
    try:
        cfg = src_cfg(offload=True)
        tracker = BlockChainTracker(cfg, LimitsConfig(), RecordingSink(), key_block_size=KB)
        src = ZmqEventSource(cfg, LimitsConfig(), tracker, ListenerMetrics(), ctx, keep_log=True)
    finally:
        ctx.destroy(linger=0)
    assert src.log.treat_eviction_as_offload


# -- 5. one writer per state file --------------------------------------------------------------------------------


def test_each_write_uses_its_own_tmp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = state_file.os.open

    def spy(path: str, *args: Any) -> int:
        opened.append(path)
        return real_open(path, *args)

    monkeypatch.setattr(state_file.os, "open", spy)
    path = str(tmp_path / "state.bin")
    st = {"e1": SourceState("f", 1, b"d", [])}
    write_state_file(path, st, 1 << 20)
    write_state_file(path, st, 1 << 20)
    tmps = [p for p in opened if p.startswith(path + ".")]
    assert len(tmps) == 2 and tmps[0] != tmps[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


class _Counting(concurrent.futures.ThreadPoolExecutor):
    submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        type(self).submitted += 1
        return super().submit(*args, **kwargs)


class _Src:
    """The least a persister needs of a source."""

    name = "e1"

    def __init__(self) -> None:
        self.log = EventLog()
        self.seq = 1

    def fingerprint(self) -> str:
        return "f"

    def persisted(self) -> tuple[int | None, bytes | None, list[bytes] | None]:
        return self.seq, b"d", None

    def restore(self, state: SourceState) -> None:
        pass


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


# -- the restored state equals the state of a listener that never restarted -------------------------------------


def random_workload(rng: random.Random, n: int) -> list[list[dict[str, Any]]]:
    """Batches of GPU stores (roots, extensions, second copies), GPU removals (ancestors, whole chains), CPU
    placeholders (of known and of forgotten blocks), CPU removals, STORAGE copies (placeholders and stores
    with tokens) and their removals, and a rare AllBlocksCleared."""
    chains: list[list[int]] = []
    info: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens): hashes are deterministic
    next_hash = 1
    batches: list[list[dict[str, Any]]] = []

    def run_of(chain: list[int]) -> list[int]:
        i = rng.randrange(len(chain))
        return chain[i : rng.randint(i + 1, len(chain))]

    def stored(hashes: list[int], medium: str) -> dict[str, Any]:
        tokens = [t for h in hashes for t in info[h][1]]
        return store(hashes, info[hashes[0]][0], tokens, medium)

    for _ in range(n):
        batch: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if not chains or r < 0.25:
                parent_chain = rng.choice(chains) if chains and rng.random() < 0.5 else None
                parent = parent_chain[-1] if parent_chain else None
                hashes = []
                for _ in range(rng.randint(1, 3)):
                    info[next_hash] = (parent, toks(next_hash))
                    parent = next_hash
                    hashes.append(next_hash)
                    next_hash += 1
                chains.append((parent_chain or []) + hashes)
                batch.append(stored(hashes, "GPU"))
            elif r < 0.33:
                batch.append(stored(run_of(rng.choice(chains)), "GPU"))  # a second copy (or a re-store)
            elif r < 0.50:
                batch.append(remove(run_of(rng.choice(chains)), "GPU"))
            elif r < 0.62:
                batch.append(placeholder(run_of(rng.choice(chains)), rng.choice(["CPU", "CPU", "STORAGE"])))
            elif r < 0.72:
                batch.append(remove(run_of(rng.choice(chains)), rng.choice(["CPU", "CPU", "STORAGE"])))
            elif r < 0.80:
                batch.append(stored(run_of(rng.choice(chains)), "STORAGE"))
            elif r < 0.81:
                batch.append({"type": "AllBlocksCleared"})
            elif r < 0.86 and len(chains) > 8:
                chains.pop(rng.randrange(len(chains)))
        batches.append(batch)
    return batches


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_compacted_log_rebuilds_the_never_restarted_state(seed: int, offload: bool) -> None:
    rng = random.Random(seed * 2 + offload)
    batches = random_workload(rng, 300)
    ref = Live(offload)
    current = Live(offload)
    restarts = sorted(rng.sample(range(1, len(batches)), 4))
    sizes = []
    for i, batch in enumerate(batches):
        if i in restarts:
            current = current.restored()
            assert current.sink.state == ref.sink.state, f"restart before batch {i}"
            sizes.append(len(ref.sink.state))
        ref.apply(batch)
        current.apply(batch)
    assert max(sizes) > 0, "the workload leaves blocks"
    assert current.sink.state == ref.sink.state
    final = current.restored()
    assert final.sink.state == ref.sink.state


async def test_listener_apps_restore_from_a_state_file(tmp_path: Path) -> None:
    """The whole path (persister, file, source) with placeholders and offload copies."""
    src = src_cfg(offload=True)
    cfg = ListenerConfig(
        listen="127.0.0.1:0", key_block_size=KB, sources=(src,), state=StateConfig(path=str(tmp_path / "s.bin"))
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
