"""listener.state_log: the compacted event log rebuilds, through the decoder and the tracker, the state of a listener
that never restarted: CPU placeholders and ``treat_eviction_as_offload`` copies survive compaction, ancestors
removed after their children were stored, second copies, and a seeded random workload mixing every kind of copy;
the log's memory bound and its recovery at the next clear."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from listener.app import ListenerApp
from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.msgpack_decoder import decode_batch
from listener.state_log import EventLog, batch_payload, compact
from listener.zmq_source import ZmqEventSource
from tests.support.recording_sink import RecordingSink
from tests.unit.listener.fake_engines import PAGE, stored, tokens, workload

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


# -- CPU placeholders --------------------------------------------------------------------------------------------


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


# -- treat_eviction_as_offload -----------------------------------------------------------------------------------


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


# -- the log of a stream, compacted -------------------------------------------------------------------------------
async def test_compacted_log_rebuilds_the_same_state() -> None:
    """The compacted log (what the state file holds) replays through the decoder and the tracker to the
    state the full stream built: ancestors removed after their children were stored, second copies."""
    engine_cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=PAGE,
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=PAGE, zmq_endpoint="tcp://127.0.0.1:1"),),
    )
    full, rebuilt = ListenerApp(engine_cfg), ListenerApp(engine_cfg)
    sources = [app.sources["e1"] for app in (full, rebuilt)]
    assert all(isinstance(s, ZmqEventSource) for s in sources)
    full_src, rebuilt_src = (s for s in sources if isinstance(s, ZmqEventSource))
    log = EventLog()
    batches = workload(400, seed=3, tag=2)
    for b in batches:
        payload = msgpack.packb([0.0, b, 0])
        await full_src.apply_payload(payload)
        log.record(payload)
    done = compact(log.view())
    assert len(done.events) < sum(len(b) for b in batches)  # removed chains are gone
    await rebuilt_src.apply_payload(batch_payload(done.events))
    assert full.feeds["e1"].state and rebuilt.feeds["e1"].state == full.feeds["e1"].state


def test_event_log_is_bounded_and_recovers_at_the_next_clear() -> None:
    log = EventLog(max_entries=10)
    for i in range(11):
        log.record(msgpack.packb([0.0, [stored([i], None, tokens(i, 1))], 0]))
    assert log.overflow and len(log) == 0  # gave up: saved without events, restored empty
    log.record(msgpack.packb([0.0, [stored([99], None, tokens(99, 1))], 0]))
    assert len(log) == 0
    log.record(msgpack.packb([0.0, [["AllBlocksCleared"], stored([7], None, tokens(7, 1))], 0]))
    assert not log.overflow and len(log) == 1


def test_what_the_log_keeps_and_what_a_save_may_drop() -> None:
    """A removed chain leaves nothing to replay; garbage is collected only once it outweighs what was kept; a
    payload the decoder refuses changes the version (a save notices) but not the log."""
    log = EventLog()
    log.record(msgpack.packb([0.0, [stored([1], None, tokens(1, 1)), stored([2], 1, tokens(2, 1))], 0]))
    log.record(msgpack.packb([0.0, [["BlockRemoved", [2], "GPU"]], 0]))
    view = log.view()
    done = compact(view)
    assert [msgpack.unpackb(e)[1] for e in done.events] == [[1]]  # the store of 2 and its removal are gone
    log.gc(done, view.last_id)
    assert len(log) == 3  # below 2 × max(kept, 1024) entries: nothing collected yet
    version = log.version
    log.record(b"\xc1")  # not msgpack
    assert log.version == version + 1 and len(log) == 3
    big = EventLog()
    for i in range(2100):  # stored then removed: garbage past 2 × 1024 entries
        big.record(msgpack.packb([0.0, [stored([i], None, tokens(i, 1)), ["BlockRemoved", [i], "GPU"]], 0]))
    view = big.view()
    big.gc(compact(view), view.last_id)
    assert len(big) == 0


def test_batch_payload_is_a_batch_the_decoder_reads() -> None:
    events = [msgpack.packb(stored([i], None, tokens(i, 1))) for i in range(3)]
    batch = decode_batch(batch_payload(events), "vllm", LimitsConfig().max_event_tokens)
    assert [e.block_hashes for e in batch.events] == [(0,), (1,), (2,)] and not batch.dropped
