"""Flow control's queues without the controller: a flow's FCFS and earliest-deadline order, removal from the
middle and compaction, and the three fairness policies of a band."""

from __future__ import annotations

import asyncio

from picker.flow.queues import Band, Flow, Item


def item(fid: str, seq_deadline: float = 0.0, cost: int = 1) -> Item:
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[object] = loop.create_future()
    finally:
        loop.close()
    return Item(fid, 0, 1, cost, 0.0, 100.0, seq_deadline, fut, lambda: None)


def test_fcfs_keeps_arrival_order_and_skips_what_left_from_the_middle() -> None:
    f = Flow(("a", 0), edf=False)
    a, b, c = item("a"), item("a"), item("a")
    for i in (a, b, c):
        f.push(i)
    b.gone = True
    f.forget(b)
    assert f.pop() is a and f.pop() is c and f.head() is None and f.live == 0


def test_edf_pops_the_earliest_deadline_first() -> None:
    f = Flow(("a", 0), edf=True)
    late, soon, mid = item("a", 9.0), item("a", 1.0), item("a", 5.0)
    for i in (late, soon, mid):
        f.push(i)
    assert [f.pop() for _ in range(3)] == [soon, mid, late]


def test_a_flow_mostly_gone_is_compacted_to_what_remains() -> None:
    f = Flow(("a", 0), edf=False)
    items = [item("a") for _ in range(200)]
    for i in items:
        f.push(i)
    for i in items[:150]:
        i.gone = True
        f.forget(i)
    assert len(f._fifo) <= 100  # compacted once fewer than half were live
    assert f.items() == items[150:] and f.live == 50


def band_with(fairness: str, flows: dict[str, list[Item]]) -> Band:
    band = Band(0, fairness)
    for fid, its in flows.items():
        f = Flow((fid, 0), edf=False)
        for i in its:
            f.push(i)
        band.add(f)
    return band


def drain(band: Band) -> list[str]:
    out = []
    while (f := band.pick()) is not None:
        i = f.pop()
        band.served(f, i)
        out.append(i.fairness_id)
    return out


def test_global_fifo_follows_arrival_across_flows() -> None:
    x1, y1, x2 = item("x"), item("y"), item("x")
    assert drain(band_with("global_fifo", {"x": [x1, x2], "y": [y1]})) == ["x", "y", "x"]


def test_round_robin_alternates_flows_whatever_their_lengths() -> None:
    band = band_with("round_robin", {"x": [item("x") for _ in range(3)], "y": [item("y")]})
    assert drain(band) == ["x", "y", "x", "x"]


def test_token_weighted_gives_the_cheap_flow_as_many_tokens_as_the_expensive_one() -> None:
    band = band_with(
        "token_weighted",
        {"big": [item("big", cost=1000) for _ in range(3)], "small": [item("small", cost=100) for _ in range(30)]},
    )
    order = drain(band)
    first_two_big = [i for i, f in enumerate(order) if f == "big"][:2]
    assert first_two_big[1] - first_two_big[0] - 1 >= 9  # ~1000/100 small ones between two big ones


def test_a_flow_that_returns_starts_at_the_bands_virtual_time_not_with_saved_credit() -> None:
    band = band_with("token_weighted", {"busy": [item("busy", cost=100) for _ in range(50)]})
    for _ in range(40):
        f = band.pick()
        assert f is not None
        band.served(f, f.pop())
    idle = Flow(("idle", 0), edf=False)
    for _ in range(20):
        idle.push(item("idle", cost=100))
    band.add(idle)  # joins at the band's clock: it alternates with busy instead of taking 40 turns in a row
    assert drain(band)[:6] in (["idle", "busy"] * 3, ["busy", "idle"] * 3)
