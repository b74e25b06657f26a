"""One exchange from the commit to the end of its response: the end runs once and frees the slot once, body chunks
go only to body observers, the first byte settles the lease's prefill by the rules of ``Lease.first_byte``, a
placement is undone when the response failed or came from elsewhere, and a raising observer is contained."""

from __future__ import annotations

import logging

import pytest

from picker.cache.state import CacheState
from picker.config import PoolConfig
from picker.facts import RequestFacts
from picker.kv.placements import RecentPlacements
from picker.kv.stage import KvCommit
from picker.pool.pool import Pool
from picker.request.exchange import OBSERVER_FAILURES, Exchange, ResponseObserver
from picker.routing.endpoints import Decision, Endpoint

A, B = Endpoint("a", "10.0.0.1:80"), Endpoint("b", "10.0.0.2:80")


class Tap:
    def __init__(self, wants_body: bool = False) -> None:
        self.wants_body = wants_body
        self.events: list[tuple[str, object]] = []

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        self.events.append(("headers", status))

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        self.events.append(("body", chunk))

    def on_end(self, ex: Exchange, completed: bool) -> None:
        self.events.append(("end", completed))


def pool() -> Pool:
    return Pool(PoolConfig(backends=[{"name": e.name, "address": e.address} for e in (A, B)]))


def exchange(
    p: Pool,
    observers: tuple[ResponseObserver, ...] = (),
    body_observers: tuple[ResponseObserver, ...] = (),
    calibrate: bool = False,
) -> Exchange:
    lease = p.acquire(A, prefill_tokens=100, calibrate=calibrate)
    return Exchange(
        RequestFacts(api="chat"), Decision(A, "RoundRobin", "round_robin"), lease, observers, body_observers
    )


def test_the_end_runs_once_frees_the_slot_once_and_keeps_the_first_verdict() -> None:
    p, tap = pool(), Tap()
    other = p.acquire(A)  # another request on the same endpoint: its slot must survive
    ex = exchange(p, (tap,))
    assert p.in_flight()["a"] == 2
    ex.end(completed=False)
    ex.end(completed=True)
    assert tap.events == [("end", False)] and p.in_flight()["a"] == 1
    other.release()


def test_body_chunks_reach_only_body_observers_and_the_last_one_ends_the_exchange() -> None:
    p, plain, body = pool(), Tap(), Tap(wants_body=True)
    ex = exchange(p, (plain, body), ())
    assert not ex.wants_body
    ex.add_body_observer(body)
    assert ex.wants_body
    ex.response_headers(200)
    ex.response_body(b"a", end=False)
    ex.response_body(b"b", end=True)
    ex.end(completed=False)  # the stream's close afterwards
    assert plain.events == [("headers", 200), ("end", True)]
    assert body.events == [("headers", 200), ("body", b"a"), ("body", b"b"), ("end", True)]
    assert p.in_flight()["a"] == 0


def test_the_response_headers_record_status_and_served_and_the_first_byte() -> None:
    p = pool()
    ex = exchange(p)
    assert (ex.status, ex.served, ex.first_byte_at) == (None, None, None)
    ex.response_headers(200, "10.0.0.1:80")
    assert (ex.status, ex.served) == (200, "10.0.0.1:80") and ex.first_byte_at is not None
    assert ex.first_byte_at >= ex.decided_at
    st = p.view().by_name()["a"]
    assert (st.pending_prefill_tokens, st.decoding) == (0, 1)  # no KV events awaited: prefilled at the headers


@pytest.mark.parametrize(
    ("status", "served", "prefilled"),
    [
        (200, None, False),
        (200, "10.0.0.1:80", False),
        (503, None, True),
        (200, "10.0.0.2:80", True),
        (None, None, True),
    ],
)
def test_a_lease_awaiting_kv_events_is_settled_at_the_headers_only_when_the_answer_failed(
    status: int | None, served: str | None, prefilled: bool
) -> None:
    ex = exchange(pool(), calibrate=True)
    assert ex.lease.awaits_kv
    ex.response_headers(status, served)
    assert ex.lease.first_byte_seen is prefilled


@pytest.mark.parametrize(
    ("status", "served", "kept"),
    [(200, None, True), (200, "10.0.0.1:80", True), (404, None, False), (503, None, False),
     (200, "10.0.0.2:80", False), (None, None, False)],
)  # fmt: skip
def test_a_placement_stays_only_when_the_pick_answered_under_400(
    status: int | None, served: str | None, kept: bool
) -> None:
    placements = RecentPlacements(ttl_seconds=30)
    placements.record("a", [1, 2], now=0.0)
    ex = exchange(pool())
    ex.kv = KvCommit(prompt_tokens=32, predicted_cached=0, available_cached=0, placed=(placements, "a", [1, 2]))
    ex.response_headers(status, served)
    assert placements.holds([1, 2], now=1.0) == ({"a": 2} if kept else {})
    assert (ex.kv.placed is not None) is kept


def test_x_cache_is_the_cache_states_value_or_none_without_the_cache() -> None:
    ex = exchange(pool())
    assert ex.x_cache is None
    ex.cache = CacheState("MISS")
    assert ex.x_cache == "MISS"


class RaisesOnEnd(Tap):
    def on_end(self, ex: Exchange, completed: bool) -> None:
        raise RuntimeError("observer bug")


def test_a_raising_observer_is_counted_every_time_logged_the_first_and_every_thousandth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p, after = pool(), Tap()
    key = ("RaisesOnEnd", "on_end")
    before = OBSERVER_FAILURES.get(key, 0)
    caplog.set_level(logging.ERROR, logger="kv_epp.request")
    for _ in range(1001):
        exchange(p, (RaisesOnEnd(), after)).end(completed=True)
    assert OBSERVER_FAILURES[key] == before + 1001
    assert len(after.events) == 1001 and p.in_flight()["a"] == 0  # the others ran, every slot freed
    logged = [r for r in caplog.records if "event=response_observer_failed" in r.getMessage()]
    assert len(logged) == sum(n % 1000 == 1 for n in range(before + 1, before + 1002))  # 1st and 1001st: 2
    assert all(r.exc_info is not None for r in logged)
