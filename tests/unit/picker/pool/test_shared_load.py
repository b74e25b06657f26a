"""The shared load view's pure parts: the stream entry's wire form and its checks, the peer table's liveness and
sums, the pool's use of the peers' load, and the placements journal (docs/scale-out.md)."""

from __future__ import annotations

import json
import struct

import pytest
from prometheus_client import CollectorRegistry

from picker.config import ConfigError, CostModelConfig, PoolConfig, SharedLoadConfig, parse_settings
from picker.kv.placements import RecentPlacements
from picker.pool.pool import Pool
from picker.pool.shared_load import PeerMessage, PeerTable, SharedLoad, decode, encode
from picker.routing.cost_model import CostScorer


def pool_of(n: int = 2) -> Pool:
    return Pool(PoolConfig(backends=[{"name": f"b{i}", "address": f"10.0.0.{i}:8000"} for i in range(n)]))


def msg(
    pid: str = "p1", seq: int = 1, load: dict[str, tuple[int, int, int]] | None = None, **kw: object
) -> PeerMessage:
    return PeerMessage(pid, seq, 1000.0, load if load is not None else {"b0": (2, 300, 1)}, **kw)  # type: ignore[arg-type]


def test_an_entry_round_trips_with_load_placements_and_bye() -> None:
    m = msg(placements=[("+", "b0", [1, 2, 2**64 - 1]), ("-", "b1", [7])], bye=True)
    out = decode(encode(m), max_keys=100)
    assert out == m
    # what redis-py hands back: bytes keys and values
    raw = {k.encode(): v for k, v in encode(m).items()}
    assert decode(raw, max_keys=100) == m


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"v": b"2"}, "version"),
        ({"id": b""}, "picker id"),
        ({"id": b"x" * 129}, "picker id"),
        ({"load": b"[1,2]"}, "load must be"),
        ({"load": json.dumps({"b0": [1, 2]}).encode()}, "load entry"),
        ({"load": json.dumps({"b0": [1, -2, 0]}).encode()}, "count"),
        ({"load": json.dumps({"b0": [1, 2.5, 0]}).encode()}, "count"),
        ({"load": json.dumps({"b0": [True, 0, 0]}).encode()}, "count"),
        ({"load": json.dumps({"x" * 300: [1, 0, 0]}).encode()}, "load entry"),
        ({"pl": b"*" + struct.pack(">HI", 2, 0) + b"b0"}, "op"),
        ({"pl": b"+" + struct.pack(">HI", 2, 5) + b"b0" + b"\0" * 8}, "runs past"),
        ({"pl": b"+" + struct.pack(">HI", 2, 11) + b"b0" + b"\0" * 88}, "more than 10"),
    ],
)
def test_a_malformed_entry_is_refused_with_what_is_wrong(change: dict[str, bytes], why: str) -> None:
    fields = {**encode(msg()), **change}
    with pytest.raises(ValueError, match=why):
        decode(fields, max_keys=10)


def test_a_truncated_record_header_is_an_error_not_a_crash() -> None:
    with pytest.raises(struct.error):
        decode({**encode(msg()), "pl": b"+\0"}, max_keys=10)


def test_the_table_sums_peers_and_drops_the_silent_ones_after_the_ttl() -> None:
    t = PeerTable(ttl_s=2.0, max_peers=8)
    assert t.apply(msg("p1", load={"b0": (2, 100, 1)}), seen=10.0)
    assert t.apply(msg("p2", load={"b0": (1, 50, 0), "b1": (3, 0, 3)}), seen=10.5)
    assert t.totals() == {"b0": (3, 150, 1), "b1": (3, 0, 3)}
    assert not t.apply(msg("p1", seq=2, load={"b0": (2, 100, 1)}), seen=11.0)  # the same load: alive, no change
    assert t.expire(12.4) == []
    assert t.expire(12.6) == ["p2"]  # silent since 10.5
    assert t.totals() == {"b0": (2, 100, 1)}
    assert t.expire(13.1) == ["p1"]
    assert t.totals() == {}


def test_the_last_entry_read_is_the_peers_load_whatever_its_sequence() -> None:
    """One stream orders every entry: a peer restarted under the same id (its sequence from 0 again) is taken at
    its word at once."""
    t = PeerTable(ttl_s=2.0, max_peers=8)
    t.apply(msg("p1", seq=5, load={"b0": (5, 0, 0)}), seen=1.0)
    assert t.apply(msg("p1", seq=0, load={"b0": (1, 0, 0)}), seen=1.2)
    assert t.totals() == {"b0": (1, 0, 0)}


def test_a_deeply_nested_or_huge_load_is_malformed_not_a_crash() -> None:
    pool = pool_of(1)
    view = SharedLoad(SharedLoadConfig(enabled=True), pool, lambda _t: None, CollectorRegistry())
    for load in (b"[" * 100_000, b"{" + b" " * (1 << 20) + b"}"):
        view._take({**encode(msg()), "load": load}, seen=1.0, placements=True)
    assert view.metrics.messages.labels("received", "malformed")._value.get() == 2
    assert view.table.peers == {}


def test_a_namesake_process_is_said_once_and_a_predecessor_is_not() -> None:
    pool = pool_of(1)
    view = SharedLoad(SharedLoadConfig(enabled=True, picker_id="me"), pool, lambda _t: None, CollectorRegistry())
    view._take(encode(msg("me", nonce="old-process")), seen=1.0, placements=False)  # the seed: a predecessor
    assert not view.duplicate_id_seen
    view._take(encode(msg("me", nonce=view.nonce)), seen=1.0, placements=True)  # our own entry
    assert not view.duplicate_id_seen
    view._take(encode(msg("me", nonce="another-process")), seen=1.0, placements=True)
    assert view.duplicate_id_seen and view.table.peers == {}


def test_a_member_joining_or_back_from_standby_takes_the_peers_last_sums() -> None:
    cfg = PoolConfig(backends=[{"name": f"b{i}", "address": f"10.0.0.{i}:8000"} for i in range(2)])
    pool = Pool(cfg)
    b0, b1 = pool.endpoint("b0"), pool.endpoint("b1")
    assert b0 is not None and b1 is not None
    b2 = type(b0)("b2", "10.0.0.2:8000")
    pool.set_peer_load({"b1": (5, 500, 0), "b2": (7, 0, 0)})
    pool.update(cfg, members=[b0], standby=[b1])  # b1 not Ready: its peers' load is not summed while aside
    assert pool.health_snapshot()[0]["backend"] == "b0"
    pool.update(cfg, members=[b0, b1, b2])  # b1 back, b2 new: both carry the peers' sums at once
    states = pool.view().by_name()
    assert states["b1"].in_flight == 5 and states["b1"].pending_prefill_tokens == 500
    assert states["b2"].in_flight == 7
    pool.set_peer_load({})
    pool.update(cfg, members=[b0], standby=[b1])
    pool.update(cfg, members=[b0, b1])
    assert pool.view().by_name()["b1"].in_flight == 0  # nothing stale came back from standby


def test_trimming_keeps_the_newest_placements_and_a_reinsert_moves_a_key_last() -> None:
    p = RecentPlacements(max_entries=3, ttl_seconds=10)
    p.record("b0", [1, 2, 3], now=0.0)
    p.record("b1", [1], now=1.0)  # key 1 placed again: the newest now
    p.record("b0", [4], now=2.0)  # over the bound: the oldest (2) goes, not 1
    assert p.holds([1], now=2.0) == {"b1": 1} and p.holds([2], now=2.0) == {} and len(p) == 3
    p.record("b0", [5], now=11.5)  # past the TTL: 3 (placed at 0) expired
    assert p.holds([3], now=11.5) == {} and p.holds([5], now=11.5) == {"b0": 1}


def test_a_bye_drops_the_peer_at_once_and_peers_beyond_the_bound_are_ignored() -> None:
    t = PeerTable(ttl_s=2.0, max_peers=2)
    t.apply(msg("p1"), 1.0)
    t.apply(msg("p2"), 1.0)
    assert not t.apply(msg("p3"), 1.0)
    assert t.ignored == 1 and set(t.peers) == {"p1", "p2"}
    assert t.apply(msg("p1", bye=True), 1.1)
    assert set(t.peers) == {"p2"}


def test_the_pool_scores_on_its_own_counts_plus_the_peers() -> None:
    pool = pool_of(2)
    b0 = pool.endpoint("b0")
    assert b0 is not None
    lease = pool.acquire(b0, prefill_tokens=100)
    pool.set_peer_load({"b0": (3, 900, 1), "b1": (1, 0, 1), "gone": (9, 9, 9)})
    states = pool.view().by_name()
    assert (states["b0"].in_flight, states["b0"].pending_prefill_tokens, states["b0"].decoding) == (4, 1000, 1)
    assert (states["b1"].in_flight, states["b1"].decoding) == (1, 1)
    assert pool.own_load() == {"b0": (1, 100, 0)}  # what it publishes: its own counts only
    snap = {e["backend"]: e for e in pool.health_snapshot()}
    assert snap["b0"]["in_flight_requests"] == 1 and snap["b0"]["peer_in_flight_requests"] == 3
    lease.release()
    pool.set_peer_load({})
    states = pool.view().by_name()
    assert states["b0"].in_flight == 0 and states["b0"].pending_prefill_tokens == 0
    assert pool.own_load() == {}


def test_the_cost_model_sends_the_next_request_away_from_the_peers_queue() -> None:
    """The herding the view removes: without the peers' load both endpoints look idle and the tie goes by hash;
    with it the endpoint the other pickers loaded is predicted slower."""
    scorer = CostScorer(CostModelConfig(), block_size=16)
    pool = pool_of(2)
    key = next(k for k in (bytes([i]) for i in range(256)) if scorer.score({}, 512, pool.view(), k).best.name == "b0")
    pool.set_peer_load({"b0": (6, 6 * 2000, 0)})
    result = scorer.score({}, 512, pool.view(), key)
    assert result is not None and result.best.name == "b1"


def test_every_lease_change_tells_the_load_listener() -> None:
    pool = pool_of(1)
    calls: list[int] = []
    pool.load_listener = lambda: calls.append(1)
    ep = pool.endpoint("b0")
    assert ep is not None
    lease = pool.acquire(ep, 10)
    lease.first_byte()
    lease.release()
    assert len(calls) == 3


def test_own_placements_are_journaled_and_a_peers_are_not() -> None:
    p = RecentPlacements(max_entries=100, ttl_seconds=30)
    seen: list[tuple[str, str, list[int]]] = []
    p.journal = lambda op, b, keys: seen.append((op, b, list(keys)))
    p.record("b0", [1, 2], now=1.0)
    p.unrecord("b0", [1, 2])
    p.record("b1", [3], now=1.0, journal=False)
    p.unrecord("b1", [3], journal=False)
    assert seen == [("+", "b0", [1, 2]), ("-", "b0", [1, 2])]


def test_the_view_publishes_placements_only_while_up_and_bounds_its_outbox() -> None:
    pool = pool_of(1)
    placements = RecentPlacements(max_entries=100, ttl_seconds=30)
    cfg = SharedLoadConfig(enabled=True, max_placement_keys=4)
    view = SharedLoad(cfg, pool, lambda _t: None, CollectorRegistry(), placements=placements)
    placements.record("b0", [1, 2], now=1.0)
    assert view._take_placements() == []  # not up: nothing kept
    view.state = "up"
    placements.record("b0", list(range(1000, 1006)), now=1.0)  # longer than an entry: cut, the rest counted
    assert view.metrics.placement_keys_dropped._value.get() == 2
    view._take_placements()
    for i in range(10):
        placements.record("b0", [i, i + 100], now=1.0)
    # 4 x 4 keys kept at most: the oldest records went first
    assert view._outbox_keys <= 16
    first = view._take_placements()
    assert sum(len(k) for _, _, k in first) <= 4 and first[0][2] == [2, 102]
    off = SharedLoad(cfg.model_copy(update={"max_placement_keys": 0}), pool_of(1), lambda _t: None, CollectorRegistry())
    off.state = "up"
    off._journal("+", "b0", [1, 2])
    assert off._outbox_keys == 0 and not off._outbox


def test_a_peer_placement_counts_as_a_hold_until_the_feed_settles_it() -> None:
    pool = pool_of(2)
    placements = RecentPlacements(max_entries=100, ttl_seconds=30)
    view = SharedLoad(SharedLoadConfig(enabled=True), pool, lambda _t: None, CollectorRegistry(), placements=placements)
    peer = msg("p9", placements=[("+", "b1", [11, 12, 13]), ("+", "nope", [11])])
    view._take(encode(peer), seen=5.0, placements=True)
    assert placements.holds([11, 12, 13, 14], now=5.1) == {"b1": 3}
    placements.wrote("b1", [11, 12, 13])  # the engine's KV events arrived: the index holds the truth now
    assert placements.holds([11, 12, 13], now=5.2) == {}
    view._take(encode(msg("p9", seq=2)), seen=5.3, placements=True)
    view._after_read(5.3)
    assert pool.view().by_name()["b0"].in_flight == 2


def test_the_config_refuses_a_ttl_shorter_than_two_heartbeats_with_its_path() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"shared_load": {"enabled": True, "heartbeat_ms": 500, "peer_ttl_ms": 900}})
    assert any(path.startswith("shared_load") for path, _ in err.value.problems)
    with pytest.raises(ConfigError) as err:
        parse_settings({"shared_load": {"key": "a b"}})
    assert any(path == "shared_load.key" for path, _ in err.value.problems)
