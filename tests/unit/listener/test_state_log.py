"""listener.state_log: the compacted event log rebuilds, through the decoder and the tracker, the state of a listener
that never restarted: CPU placeholders and ``treat_eviction_as_offload`` copies survive compaction, ancestors
removed after their children were stored, second copies, and a seeded random workload mixing every kind of copy;
the log's memory bound and its recovery at the next clear."""

from __future__ import annotations

import random

import msgpack
import pytest

from listener.app import ListenerApp
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.msgpack_decoder import decode_batch
from listener.state_log import EventLog, batch_payload, compact
from listener.zmq_source import ZmqEventSource
from tests.support.fake_engines import PAGE, stored, tokens, workload
from tests.support.listener_events import MODEL, Live, placeholder, random_workload, remove, store, toks

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
