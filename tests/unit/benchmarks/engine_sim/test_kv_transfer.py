"""The simulator's prefill/decode model: a prefill stalls the streams decoding beside it, and the KV connectors
(NIXL's ``kv_transfer_params``, the shared-storage directory) move the prefill elsewhere.

The scheduler runs in process with a fake side channel (no sockets); every assertion is on accounting
(tokens, steps, held blocks), none on wall time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_transfer import (
    HeldTransfer,
    HeldTransfers,
    KvTransferError,
    KvTransferParams,
    SharedStorage,
    align_to_block_size,
    nixl_computed_tokens,
    shared_storage_load_tokens,
)
from benchmarks.engine_sim.prefix_cache import PagedPrefixCache
from benchmarks.engine_sim.scheduler import BatchScheduler, SimRequest, StepOutput, step_duration_ms
from tests.support.poll import async_wait_until

BS = 16
FAST = SimConfig(block_size=BS, time_scale=0.0001)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class FakeRemote:
    """The consumer's side channel to a producer: reads succeed unless ``fail`` says why they do not."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.reads: list[KvTransferParams] = []
        self.dones: list[KvTransferParams] = []

    async def read(self, params: KvTransferParams) -> str | None:
        self.reads.append(params)
        return self.fail

    async def done(self, params: KvTransferParams) -> None:
        self.dones.append(params)

    async def close(self) -> None:
        return None


def scheduler(config: SimConfig, remote: FakeRemote | None = None) -> BatchScheduler:
    cache = PagedPrefixCache(config.block_size, config.capacity_blocks)
    sched = BatchScheduler(config, cache, None, remote)  # type: ignore[arg-type]
    sched.start()
    return sched


async def run(sched: BatchScheduler, r: SimRequest) -> list[StepOutput]:
    """Submit ``r`` and read its outputs to the end."""
    sched.submit(r)
    items: list[StepOutput] = []
    while not items or items[-1].kind == "token":
        items.append(await asyncio.wait_for(r.outputs.get(), 10))
    return items


REMOTE_PREFILL = KvTransferParams(
    do_remote_prefill=True,
    remote_block_ids=(1, 2, 3),
    remote_engine_id="p-engine",
    remote_request_id="cmpl-p-0",
    remote_host="127.0.0.1",
    remote_port=9,
)


# -- the timing model: a prefill stalls the streams decoding beside it ----------------------------------
def test_a_step_lasts_as_long_as_its_tokens_take() -> None:
    cfg = SimConfig(step_overhead_ms=2.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5, transfer_ms_per_token=0.02)
    assert step_duration_ms(cfg, 0, 10) == pytest.approx(7.0)  # ten streams decoding alone
    assert step_duration_ms(cfg, 2038, 10) == pytest.approx(210.8)  # the same step with a prefill chunk
    assert step_duration_ms(cfg, 0, 10, loaded_tokens=1000) == pytest.approx(27.0)  # a synchronous KV load


async def test_a_prefill_shares_the_steps_of_the_streams_decoding_on_its_replica() -> None:
    cfg = dataclasses.replace(FAST, max_num_batched_tokens=512)
    sched = scheduler(cfg)
    try:
        stream = SimRequest("stream", prompt(0, 40), max_tokens=400)
        sched.submit(stream)
        await asyncio.wait_for(stream.outputs.get(), 10)  # it decodes from now on
        long = SimRequest("long", prompt(10_000, 2000), max_tokens=1)
        assert (await run(sched, long))[-1].kind == "done"
        c = sched.counters
        # every prefill chunk of the long prompt went out in a step that also decoded the stream: 4 chunks
        # (511, 511, 511, 467 tokens: the budget less the stream's decode token)
        assert c.prefill_tokens_in_decode_steps == 2000
        assert c.decode_steps_with_prefill == 4
    finally:
        await sched.stop()


# -- NIXL, the producer ---------------------------------------------------------------------------------
async def test_a_remote_decode_prefill_answers_transfer_params_and_holds_its_blocks_until_read() -> None:
    cfg = dataclasses.replace(FAST, kv_connector="nixl", kv_role="producer", name="p")
    sched = scheduler(cfg)
    sched.side_channel = ("10.0.0.7", 8200)
    try:
        r = SimRequest("cmpl-p-0", prompt(0, 100), 1, kv_params=KvTransferParams(do_remote_decode=True))
        assert [i.kind for i in await run(sched, r)] == ["token", "done"]
        out = r.kv_transfer_out
        assert out is not None
        assert out == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": out["remote_block_ids"],
            "remote_engine_id": sched.engine_id,
            "remote_request_id": "cmpl-p-0",
            "remote_host": "10.0.0.7",
            "remote_port": 8200,
            "tp_size": 1,
        }
        assert len(out["remote_block_ids"]) == 7  # ceil(100 / 16)
        assert sched.cache.held_slots > 0 and len(sched.held) == 1  # not freed at the end of the request
        assert sched.counters.kv_transfers_held == 1
        assert sched.held.done("cmpl-p-0") and sched.cache.held_slots == 0  # the consumer read them
        assert not sched.held.done("cmpl-p-0")
    finally:
        await sched.stop()


async def test_held_blocks_are_freed_at_the_timeout() -> None:
    cfg = dataclasses.replace(FAST, kv_connector="nixl", kv_role="both", kv_transfer_timeout_s=100.0)
    sched = scheduler(cfg)  # 100 simulated s = 10 ms real at this time scale
    try:
        r = SimRequest("a", prompt(0, 64), 1, kv_params=KvTransferParams(do_remote_decode=True))
        await run(sched, r)
        await async_wait_until(lambda: sched.cache.held_slots == 0, what="held blocks freed at the timeout")
        assert sched.held.expired == 1 and len(sched.held) == 0
    finally:
        await sched.stop()


async def test_only_a_producer_holds_and_only_a_finished_prefill() -> None:
    consumer = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer"))
    try:
        r = SimRequest("a", prompt(0, 64), 1, kv_params=KvTransferParams(do_remote_decode=True))
        await run(consumer, r)
        assert r.kv_transfer_out is None and consumer.cache.held_slots == 0
    finally:
        await consumer.stop()
    producer = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="producer"))
    try:
        aborted = SimRequest("b", prompt(0, 3000), 1, kv_params=KvTransferParams(do_remote_decode=True))
        producer.submit(aborted)
        producer.abort(aborted)
        await async_wait_until(lambda: aborted.finished, what="the abort handled")
        assert aborted.kv_transfer_out is None and producer.cache.held_slots == 0 and len(producer.held) == 0
    finally:
        await producer.stop()


# -- NIXL, the consumer ---------------------------------------------------------------------------------
async def test_a_remote_prefill_loads_the_prompt_and_computes_only_its_last_token() -> None:
    remote = FakeRemote()
    sched = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer"), remote)
    try:
        stream = SimRequest("stream", prompt(50_000, 40), max_tokens=300)
        sched.submit(stream)
        await asyncio.wait_for(stream.outputs.get(), 10)
        r = SimRequest("d", prompt(0, 3621), 4, kv_params=REMOTE_PREFILL)
        assert [i.kind for i in await run(sched, r)] == ["token"] * 4 + ["done"]
        assert remote.reads == [REMOTE_PREFILL] and remote.dones == [REMOTE_PREFILL]
        c = sched.counters
        assert r.cached_tokens == 3620  # vLLM after a NIXL load: the prompt less its last token
        assert c.prefill_computed_tokens == 1  # the last prompt token (the stream, still running, counts at its end)
        assert c.prefill_tokens_in_decode_steps == 1  # the stream never waited for the long prompt's prefill
        assert (c.external_prefix_cache_queries, c.external_prefix_cache_hits) == (3621 + 40, 3621)
        assert c.kv_loads == 1 and c.kv_load_failures == 0
        assert c.prefix_cache_hits == 0 and len(sched.cache) == 3621 // BS + 40 // BS  # the loaded blocks are stored
    finally:
        await sched.stop()


async def test_local_hits_are_not_transferred() -> None:
    sched = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer"), FakeRemote())
    try:
        await run(sched, SimRequest("warm", prompt(0, 320), 1))  # 20 blocks cached locally
        r = SimRequest("d", prompt(0, 1000), 1, kv_params=REMOTE_PREFILL)
        await run(sched, r)
        assert r.external_tokens == 1000 - 320 and r.cached_tokens == 999
    finally:
        await sched.stop()


async def test_a_failed_load_fails_the_request_or_recomputes_by_policy() -> None:
    remote = FakeRemote(fail="producer answered 404")
    sched = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer"), remote)
    try:
        items = await run(sched, SimRequest("d", prompt(0, 500), 2, kv_params=REMOTE_PREFILL))
        assert [(i.kind, i.status) for i in items] == [("error", 500)]
        assert "producer answered 404" in items[0].text
        assert sched.counters.kv_load_failures == 1 and sched.cache.held_slots == 0
    finally:
        await sched.stop()
    cfg = dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer", kv_load_failure_policy="recompute")
    sched = scheduler(cfg, FakeRemote(fail="producer unreachable"))
    try:
        r = SimRequest("d", prompt(0, 500), 2, kv_params=REMOTE_PREFILL)
        assert [i.kind for i in await run(sched, r)] == ["token", "token", "done"]
        assert r.cached_tokens == 0 and sched.counters.prefill_computed_tokens == 500
    finally:
        await sched.stop()


async def test_without_block_ids_or_as_a_producer_the_prompt_is_prefilled_locally() -> None:
    for role, params in (
        ("consumer", dataclasses.replace(REMOTE_PREFILL, remote_block_ids=())),
        ("producer", REMOTE_PREFILL),
    ):
        remote = FakeRemote()
        sched = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role=role), remote)  # type: ignore[arg-type]
        try:
            r = SimRequest("d", prompt(0, 200), 1, kv_params=params)
            await run(sched, r)
            assert remote.reads == [] and r.cached_tokens == 0 and sched.counters.prefill_computed_tokens == 200
        finally:
            await sched.stop()


async def test_an_abort_while_loading_frees_the_slots_and_tells_the_producer() -> None:
    class SlowRemote(FakeRemote):
        async def read(self, params: KvTransferParams) -> str | None:
            await asyncio.sleep(30)
            return None

    remote = SlowRemote()
    sched = scheduler(dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer"), remote)
    try:
        r = SimRequest("d", prompt(0, 500), 2, kv_params=REMOTE_PREFILL)
        sched.submit(r)
        await async_wait_until(lambda: sched.num_waiting == 1 and not sched.waiting, what="the load started")
        assert sched.cache.held_slots > 0
        sched.abort(r)
        assert r.finished and sched.cache.held_slots == 0 and sched.num_waiting == 0
        await async_wait_until(lambda: remote.dones == [REMOTE_PREFILL], what="the producer told")
        assert sched.counters.requests_aborted == 1
    finally:
        await sched.stop()


async def test_an_abort_before_it_was_scheduled_tells_the_producer() -> None:
    """vLLM's NixlConnector frees a producer's blocks for a request aborted while still queued (it never read
    them): the simulator as well, rather than holding them until the producer's timeout."""
    remote = FakeRemote()
    cfg = dataclasses.replace(FAST, kv_connector="nixl", kv_role="consumer")
    sched = BatchScheduler(cfg, PagedPrefixCache(cfg.block_size, cfg.capacity_blocks), None, remote)  # type: ignore[arg-type]
    try:  # not started: the request stays queued
        r = SimRequest("d", prompt(0, 500), 2, kv_params=REMOTE_PREFILL)
        sched.submit(r)
        assert r in sched.waiting
        sched.abort(r)
        assert r.finished and not sched.waiting
        await async_wait_until(lambda: remote.dones == [REMOTE_PREFILL], what="the producer told")
        assert remote.reads == []
    finally:
        await sched.stop()


# -- shared storage (ExampleConnector) ------------------------------------------------------------------
async def test_shared_storage_producer_writes_and_consumer_loads_whole_pages(tmp_path: Path) -> None:
    base = dataclasses.replace(FAST, block_size=32, kv_connector="shared-storage", kv_shared_storage_path=str(tmp_path))
    producer = scheduler(dataclasses.replace(base, kv_role="producer", name="p"))
    consumer = scheduler(dataclasses.replace(base, kv_role="consumer", name="d"))
    long = prompt(0, 3621)
    try:
        await run(producer, SimRequest("p", long, 1))
        assert producer.counters.kv_tokens_written == 3616 and len(list(tmp_path.glob("*.json"))) == 1
        r = SimRequest("d", long, 1)
        await run(consumer, r)
        # docs/wire.md section 6, measured on real vLLM: 3,616 of 3,621 tokens cached on the consumer
        assert r.cached_tokens == 3616
        c = consumer.counters
        assert c.prefill_computed_tokens == 5 and c.kv_loads == 1 and c.kv_tokens_written == 0
        assert (c.external_prefix_cache_queries, c.external_prefix_cache_hits) == (3621, 3616)
        other = SimRequest("d2", prompt(100_000, 3621), 1)  # not in the directory: prefilled locally
        await run(consumer, other)
        assert other.cached_tokens == 0 and consumer.counters.kv_loads == 1
    finally:
        await producer.stop()
        await consumer.stop()


def test_shared_storage_bounds_what_one_engine_wrote(tmp_path: Path) -> None:
    storage = SharedStorage(str(tmp_path), 16, max_entries=2, engine="p")
    prompts = [prompt(i * 1000, 100) for i in range(3)]
    assert [storage.write(p) for p in prompts] == [96, 96, 96]
    assert len(list(tmp_path.glob("*.json"))) == 2 and storage.evictions == 1
    assert storage.lookup(prompts[0]) == 0  # the oldest was deleted
    assert storage.lookup(prompts[2]) == 96
    assert storage.write(prompt(0, 16)) == 0  # shorter than a page past the last token: nothing written
    with pytest.raises(ValueError, match="kv_shared_storage_path"):
        SharedStorage("", 16, 2, "p")


def test_the_token_counts_vllm_reports() -> None:
    assert nixl_computed_tokens(3621, 16) == 3620
    assert nixl_computed_tokens(64, 16) == 63
    assert align_to_block_size(3621, 32) == 3616 and align_to_block_size(0, 32) == 0
    assert shared_storage_load_tokens(3621, 32) == 3616
    assert shared_storage_load_tokens(3617, 32) == 3584  # ExampleConnector looks up align(P - 1)


def test_held_transfers_release_once() -> None:
    released: list[str] = []
    timers: list[tuple[float, object]] = []

    class Timer:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def call_later(delay: float, callback: object) -> Timer:
        timers.append((delay, callback))
        return Timer()

    held = HeldTransfers(5.0, call_later)
    held.hold(HeldTransfer("a", 10, (1,), lambda: released.append("a")))
    assert timers[0][0] == 5.0 and held.get("a") is not None
    assert held.done("a") and released == ["a"] and held.read == 1
    assert not held.done("a") and released == ["a"]


def test_kv_transfer_params_are_read_as_nixl_sends_them() -> None:
    raw = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2], [3]],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    p = KvTransferParams.parse(raw)
    assert p is not None and p.remote_prefill and p.remote_block_ids == (1, 2, 3)
    assert KvTransferParams.parse(None) is None
    assert KvTransferParams.parse({"do_remote_decode": True}) == KvTransferParams(do_remote_decode=True)
    for bad, field in (
        ([], "must be an object"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
        ({"remote_port": 70000}, "remote_port"),
    ):
        with pytest.raises(KvTransferError, match=field):
            KvTransferParams.parse(bad)
