"""listener.state_store: the persister hands each source its saved state (same name and fingerprint), writes
the file periodically and at stop, one write at a time, and follows the set of sources. Over real ZMQ sockets:
the listener restarted while an engine keeps publishing resumes exactly (its feed state equals that of a
listener that never restarted), an engine that restarted while the listener was down has its old incarnation
cleared before any of its new blocks count, and an unverifiable incarnation is never restored (issue 8).

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/listener/test_state_store.py."""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.state_file import read_state_file
from picker.shared.block_keys import request_block_keys
from tests.support.fake_engines import Engine, stored, tokens, workload
from tests.support.listener_apps import BS, MODEL, config, record_puts, source, started
from tests.support.poll import async_wait_until


async def test_listener_restart_resumes_exactly_while_the_engine_keeps_publishing(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    script = workload(90, seed=7, tag=1)
    ref = ListenerApp(config(engine, None))  # never restarts
    first = ListenerApp(config(engine, path))
    try:
        async with started(ref):
            await first.start()
            await engine.subscribed(2)
            for b in script[:40]:
                await engine.publish(b)
            await async_wait_until(lambda: source(first).last_seq == 39 and source(ref).last_seq == 39)
            await async_wait_until(lambda: (s := read_state_file(str(path), 1 << 30).get("e1")) and s.last_seq == 39)
            first.persister = None  # a crash: nothing written at stop, the periodic file is what remains
            await first.stop()
            for b in script[40:70]:  # published while the listener is down
                await engine.publish(b)
            second = ListenerApp(config(engine, path))
            await second.start()
            try:
                for b in script[70:89]:  # published while it starts
                    await engine.publish(b)
                await engine.subscribed(1)
                last = await engine.publish(script[89])
                await async_wait_until(lambda: source(second).last_seq == last and source(ref).last_seq == last)
                assert ref.feeds["e1"].state, "the workload leaves blocks"
                assert second.feeds["e1"].state == ref.feeds["e1"].state
                assert source(second).incarnation_checks["same"] >= 1
                assert source(second).incarnation_checks["restart"] == 0
            finally:
                await second.stop()
    finally:
        await engine.close()


async def test_engine_restarted_while_the_listener_was_down_is_cleared_first(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    try:
        first = ListenerApp(config(engine, path))
        async with started(first):
            await engine.subscribed(1)
            for i in range(10):
                await engine.publish([stored([1000 + i], None, tokens(10 + i, 1))])
            await async_wait_until(lambda: source(first).last_seq == 9 and len(first.feeds["e1"].state) == 10)
            old_keys = set(first.feeds["e1"].state)
        await engine.close()  # the engine restarts while the listener is down
        engine.seq, engine.buffer = 0, {}
        await engine.open_replay()
        new_tokens = [tokens(50 + i, 1) for i in range(16)]
        for i in range(15):  # past the old last seq, published before the listener is back
            await engine.publish([stored([2000 + i], None, new_tokens[i])])
        await engine.open_pub()
        second = ListenerApp(config(engine, path))
        deltas = record_puts(second)
        async with started(second):
            await engine.subscribed(1)
            last = await engine.publish([stored([2015], None, new_tokens[15])])
            await async_wait_until(lambda: source(second).last_seq == last)
            expected = {k for t in new_tokens for k in request_block_keys(t, BS, MODEL)}
            assert set(second.feeds["e1"].state) == expected
            put = {k for op, ks in deltas if op == "put" for k in ks}
            assert not put & old_keys, "a block of the dead incarnation was published"
            assert source(second).incarnation_checks["restart"] == 1
    finally:
        await engine.close()


async def test_unverifiable_incarnation_is_never_restored(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """Persisted blocks count only once the engine proves the same incarnation: a replay ROUTER that does not
    answer (the engine is down) clears them."""
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    try:
        first = ListenerApp(config(engine, path))
        async with started(first):
            await engine.subscribed(1)
            await engine.publish([stored([1], None, tokens(1, 1))])
            await async_wait_until(lambda: len(first.feeds["e1"].state) == 1)
        assert read_state_file(str(path), 1 << 30)["e1"].events
        silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        cfg = config(engine, path)
        src_cfg = cfg.sources[0].model_copy(
            update={"replay_endpoint": f"tcp://127.0.0.1:{port}", "replay_timeout_ms": 50}
        )
        second = ListenerApp(cfg.model_copy(update={"sources": (src_cfg,)}))
        deltas = record_puts(second)
        try:
            async with started(second):
                await async_wait_until(lambda: source(second).incarnation_checks["unverifiable"] == 1)
                assert second.feeds["e1"].state == {} and not [d for d in deltas if d[0] == "put"]
        finally:
            silent.close(linger=0)
    finally:
        await engine.close()
