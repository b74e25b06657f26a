"""Flow control's controller: dispatch at once while the pool has room, queue while it is saturated, bands in
strict priority order, fairness between flows, ordering inside a flow, TTLs, bounds, cancellation, shutdown and
reload. A real ``Pool`` (static backends) whose in-flight count is the saturation signal; a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from picker.config import parse_settings
from picker.facts import Answer
from picker.flow.controller import (
    DROPPED_HEADER,
    FlowController,
    parse_slo_ms,
    parse_ttl,
)
from picker.pool.pool import Lease, Pool
from picker.routing.endpoints import EngineSignals


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    flow: dict[str, Any] | None = None, backends: int = 1, engine_signals: bool = False
) -> tuple[FlowController, Pool, Clock]:
    cfg = {"enabled": True, "saturation": {"in_flight_threshold": 1, "queue_depth_threshold": 0}} | (flow or {})
    s = parse_settings(
        {
            "pool": {"backends": [{"name": f"b{i}", "address": f"10.0.0.{i + 1}:80"} for i in range(backends)]},
            "flow_control": cfg,
        }
    )
    clock = Clock()
    pool = Pool(s.pool, clock=clock)
    fc = FlowController(s.flow_control, pool, engine_signals=engine_signals, clock=clock)
    pool.change_listener = fc.wake
    return fc, pool, clock


def fill(pool: Pool) -> list[Lease]:
    """One request in flight on every endpoint: saturation 1.0 with in_flight_threshold 1."""
    return [pool.acquire(s.endpoint) for s in pool.view().states]


class Runs:
    """Records the order dispatch ran requests in; each run takes a slot on the pool (as commit does)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.order: list[str] = []
        self.leases: list[Lease] = []

    def __call__(self, name: str, take_slot: bool = True) -> Any:
        def run() -> str:
            self.order.append(name)
            if take_slot:
                self.leases.append(self.pool.acquire(self.pool.view().states[0].endpoint))
            return name

        return run

    def finish_one(self) -> None:
        self.leases.pop(0).release()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_pool_with_room_runs_the_request_at_once_without_queueing() -> None:
    fc, pool, _ = make()
    runs = Runs(pool)
    assert await fc.admit({}, 100, 10, runs("a")) == "a"
    assert fc.requests == 0 and fc.totals["dispatched"] == 1


async def test_a_saturated_pool_queues_and_a_released_slot_dispatches_the_next() -> None:
    fc, pool, _ = make()
    held = fill(pool)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({}, 100, 10, runs("a")))
    await settle()
    assert not task.done() and fc.requests == 1 and fc.bytes == 100
    held[0].release()  # the slot frees: the pool's change wakes the dispatcher
    assert await task == "a"
    assert fc.requests == 0 and fc.bytes == 0


async def test_bands_drain_in_strict_priority_order_whatever_the_arrival_order() -> None:
    fc, pool, _ = make({"objectives": {"critical": {"priority": 10}, "batch": {"priority": -1}}})
    held = fill(pool)
    runs = Runs(pool)
    tasks = [
        asyncio.create_task(fc.admit({"x-llm-d-inference-objective": obj}, 1, 1, runs(name)))
        for name, obj in (("batch", "batch"), ("std", "unknown-objective"), ("crit", "critical"))
    ]
    await settle()
    for lease in held:
        lease.release()
    for _ in range(3):
        await settle()
        if runs.leases:
            runs.finish_one()
    await asyncio.gather(*tasks)
    assert runs.order == ["crit", "std", "batch"]


async def test_a_new_request_waits_behind_queued_ones_of_its_band_even_when_a_slot_is_free() -> None:
    fc, pool, _ = make()
    held = fill(pool)
    runs = Runs(pool)
    first = asyncio.create_task(fc.admit({}, 1, 1, runs("first")))
    await settle()
    held[0].release()
    second = asyncio.create_task(fc.admit({}, 1, 1, runs("second")))
    await settle()
    assert runs.order[0] == "first"
    runs.finish_one()
    await asyncio.gather(first, second)
    assert runs.order == ["first", "second"]


@pytest.mark.parametrize(
    ("fairness", "expected"),
    [
        ("global_fifo", ["h1", "h2", "h3", "l1", "l2"]),
        ("round_robin", ["h1", "l1", "h2", "l2", "h3"]),
    ],
)
async def test_the_fairness_policy_picks_the_flow(fairness: str, expected: list[str]) -> None:
    fc, pool, _ = make({"fairness": fairness})
    held = fill(pool)
    runs = Runs(pool)
    tasks = []
    for name in ("h1", "h2", "h3"):
        tasks.append(asyncio.create_task(fc.admit({"x-llm-d-inference-fairness-id": "heavy"}, 1, 1, runs(name))))
        await settle()
    for name in ("l1", "l2"):
        tasks.append(asyncio.create_task(fc.admit({"x-llm-d-inference-fairness-id": "light"}, 1, 1, runs(name))))
        await settle()
    held[0].release()
    for _ in range(5):
        await settle()
        if runs.leases:
            runs.finish_one()
    await asyncio.gather(*tasks)
    assert runs.order == expected


async def test_token_weighted_fairness_serves_the_flow_with_the_fewest_tokens() -> None:
    """A heavy tenant's requests cost 20x a light one's: after one heavy dispatch the light flow gets the next
    20 (request-counting fairness would alternate)."""
    fc, pool, _ = make({"fairness": "token_weighted"})
    held = fill(pool)
    runs = Runs(pool)
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(fc.admit({"x-llm-d-inference-fairness-id": "heavy"}, 1, 2000, runs(f"h{i}"))))
    for i in range(25):
        tasks.append(asyncio.create_task(fc.admit({"x-llm-d-inference-fairness-id": "light"}, 1, 100, runs(f"l{i}"))))
    await settle()
    held[0].release()
    while len(runs.order) < 28:
        await settle()
        if runs.leases:
            runs.finish_one()
    await asyncio.gather(*tasks)
    first_heavy = runs.order.index("h0")
    second_heavy = runs.order.index("h1")
    lights_between = second_heavy - first_heavy - 1
    assert lights_between >= 19  # ~2000/100 light requests for each heavy one


async def test_earliest_deadline_orders_a_flow_by_its_ttft_slo() -> None:
    fc, pool, _ = make({"ordering": "edf"})
    held = fill(pool)
    runs = Runs(pool)
    tasks = [
        asyncio.create_task(fc.admit({"x-llm-d-slo-ttft-ms": slo}, 1, 1, runs(name)))
        for name, slo in (("lax", "5000"), ("none", ""), ("tight", "100"))
    ]
    await settle()
    held[0].release()
    for _ in range(4):
        await settle()
        if runs.leases:
            runs.finish_one()
    await asyncio.gather(*tasks)
    assert runs.order == ["tight", "lax", "none"]  # no SLO: its TTL (60 s) is its deadline


async def test_a_request_past_its_ttl_is_dropped_429_with_the_reason_and_never_runs() -> None:
    fc, pool, clock = make({"default_ttl_ms": 1000})
    fill(pool)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({"x-llm-d-inference-ttl": "200ms"}, 7, 1, runs("late")))
    await settle()
    clock.now += 0.3  # past the header's 200 ms, not the config's 1 s: the smallest TTL wins
    fc.wake()
    answer = await task
    assert isinstance(answer, Answer) and answer.status == 429
    assert (DROPPED_HEADER, "rejected-ttl-expired") in answer.headers
    assert ("retry-after", "1") in answer.headers
    assert runs.order == [] and fc.requests == 0 and fc.bytes == 0
    assert fc.totals["rejected-ttl-expired"] == 1
    assert fc.stats()["latest_ttl_drop_ms"] == pytest.approx(100.0)  # dropped 100 ms after its expiry


async def test_while_the_pool_has_no_endpoint_the_no_endpoints_ttl_drops_503() -> None:
    fc, pool, clock = make({"no_endpoints_ttl_ms": 500, "default_ttl_ms": 60_000}, backends=0)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({}, 1, 1, runs("x")))
    await settle()
    assert not task.done()
    clock.now += 0.6
    fc.wake()
    answer = await task
    assert isinstance(answer, Answer) and answer.status == 503
    assert (DROPPED_HEADER, "rejected-no-endpoints") in answer.headers


async def test_a_full_band_refuses_at_once_with_rejected_saturated() -> None:
    fc, pool, _ = make({"default_band": {"max_requests": 2}, "max_bytes": 4096})
    fill(pool)
    runs = Runs(pool)
    waiting = [asyncio.create_task(fc.admit({}, 10, 1, runs(f"w{i}"))) for i in range(2)]
    await settle()
    answer = await fc.admit({}, 10, 1, runs("third"))
    assert isinstance(answer, Answer) and answer.status == 429
    assert (DROPPED_HEADER, "rejected-saturated") in answer.headers
    too_big = await fc.admit({"x-llm-d-inference-objective": "other"}, 5000, 1, runs("big"))  # over max_bytes
    assert isinstance(too_big, Answer) and (DROPPED_HEADER, "rejected-saturated") in too_big.headers
    assert fc.requests == 2 and fc.bytes == 20
    fc.close()
    await asyncio.gather(*waiting)


async def test_a_client_that_leaves_while_queued_is_counted_and_never_dispatched() -> None:
    fc, pool, _ = make()
    held = fill(pool)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({}, 50, 1, runs("gone")))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fc.requests == 0 and fc.bytes == 0 and fc.flows == 0
    assert fc.totals["rejected-context-cancelled"] == 1
    held[0].release()
    await settle()
    assert runs.order == []


async def test_a_client_that_leaves_as_its_request_is_dispatched_gets_its_slot_released() -> None:
    fc, pool, _ = make()
    held = fill(pool)
    runs = Runs(pool)
    released: list[object] = []
    task = asyncio.create_task(fc.admit({}, 1, 1, runs("r"), release=released.append))
    await settle()
    pool.change_listener = None  # dispatch by hand: step() runs it, then the cancel lands before the task resumes
    held[0].release()
    assert fc.step() == 1 and runs.order == ["r"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == ["r"]


async def test_a_client_that_left_before_the_dispatcher_reached_it_is_never_run() -> None:
    fc, pool, _ = make()
    held = fill(pool)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({}, 1, 1, runs("r")))
    await settle()
    pool.change_listener = None
    task.cancel()  # its future is cancelled now; the coroutine sees it at its next turn
    held[0].release()
    assert fc.step() == 0 and runs.order == []
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fc.totals["rejected-context-cancelled"] == 1 and fc.requests == 0


async def test_shutdown_answers_everything_queued_503_shutting_down() -> None:
    fc, pool, _ = make()
    fill(pool)
    runs = Runs(pool)
    tasks = [asyncio.create_task(fc.admit({}, 1, 1, runs(str(i)))) for i in range(3)]
    await settle()
    fc.close()
    answers = await asyncio.gather(*tasks)
    assert all(isinstance(a, Answer) and a.status == 503 for a in answers)
    assert all((DROPPED_HEADER, "rejected-shutting-down") in a.headers for a in answers)
    assert runs.order == [] and fc.requests == 0


async def test_turned_off_by_a_reload_what_waits_is_dispatched_at_once() -> None:
    fc, pool, _ = make()
    fill(pool)
    runs = Runs(pool)
    tasks = [asyncio.create_task(fc.admit({}, 1, 1, runs(str(i)))) for i in range(3)]
    await settle()
    fc.configure(parse_settings({"flow_control": {"enabled": False}}).flow_control, engine_signals=False)
    assert await asyncio.gather(*tasks) == ["0", "1", "2"]


async def test_missing_or_old_engine_signals_count_as_saturated() -> None:
    fc, pool, _ = make({"saturation": {"in_flight_threshold": 0, "queue_depth_threshold": 5}}, engine_signals=True)
    runs = Runs(pool)
    task = asyncio.create_task(fc.admit({}, 1, 1, runs("x", take_slot=False)))
    await settle()
    assert not task.done()  # no reading yet: fail closed
    pool.set_engine_signals("b0", EngineSignals(waiting=0, running=1, kv_usage=0.1, age_s=0.0))
    assert await task == "x"
    pool.set_engine_signals("b0", EngineSignals(waiting=0, running=1, kv_usage=0.1, age_s=10.0))  # too old
    late = asyncio.create_task(fc.admit({}, 1, 1, runs("y", take_slot=False)))
    await settle()
    assert not late.done()
    fc.close()
    await late


async def test_a_band_below_full_leaves_headroom_for_higher_bands() -> None:
    """With in_flight_threshold 4, one request in flight is saturation 0.25: a band limited to 0.2 waits while the
    default band (1.0) goes."""
    fc, pool, _ = make(
        {"saturation": {"in_flight_threshold": 4}, "bands": {"-1": {"saturation_limit": 0.2}},
         "objectives": {"batch": {"priority": -1}}}
    )  # fmt: skip
    pool.acquire(pool.view().states[0].endpoint)
    runs = Runs(pool)
    batch = asyncio.create_task(
        fc.admit({"x-llm-d-inference-objective": "batch"}, 1, 1, runs("batch", take_slot=False))
    )
    await settle()
    assert not batch.done()
    assert await fc.admit({}, 1, 1, runs("std", take_slot=False)) == "std"
    fc.close()
    await batch


async def test_a_band_above_full_dispatches_past_saturation_but_never_on_missing_engine_signals() -> None:
    """in_flight_threshold 1: one request in flight is saturation 1.0. The critical band (limit 1.5) goes on at
    1.0 while the default band (1.0) queues; a missing engine reading counts as 1.5, so it stops critical too."""
    cfg = {"bands": {"10": {"saturation_limit": 1.5}}, "objectives": {"critical": {"priority": 10}}}
    fc, pool, _ = make(cfg)
    fill(pool)
    runs = Runs(pool)
    std = asyncio.create_task(fc.admit({}, 1, 1, runs("std", take_slot=False)))
    await settle()
    assert not std.done()
    crit = {"x-llm-d-inference-objective": "critical"}
    assert await fc.admit(crit, 1, 1, runs("crit", take_slot=False)) == "crit"
    fc.close()
    await std

    fc, pool, _ = make(
        {**cfg, "saturation": {"in_flight_threshold": 1, "queue_depth_threshold": 5}}, engine_signals=True
    )
    assert fc.closed_level == 1.5
    task = asyncio.create_task(fc.admit(crit, 1, 1, runs("crit-unread", take_slot=False)))
    await settle()
    assert not task.done()  # no engine reading yet: fail closed for every band
    pool.set_engine_signals("b0", EngineSignals(waiting=0, running=0, kv_usage=0.1, age_s=0.0))
    assert await task == "crit-unread"
    fc.close()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("15", 15.0), ("", None), ("-1s", None),
     ("0", None), ("abc", None), ("1e3", None)],
)  # fmt: skip
def test_the_ttl_header_is_a_duration(value: str, seconds: float | None) -> None:
    assert parse_ttl(value) == seconds


def test_the_slo_header_is_milliseconds() -> None:
    assert parse_slo_ms("250") == 0.25
    assert parse_slo_ms("nan") is None and parse_slo_ms("-5") is None and parse_slo_ms("x") is None
