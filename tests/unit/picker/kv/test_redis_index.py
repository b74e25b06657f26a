"""``RedisKvIndex``'s write queue and its answers while Redis is down, without a server (no call reaches the
client in these tests: the writer task is not running). The Valkey tests are in
tests/integration/test_redis_kv_index_valkey.py."""

from __future__ import annotations

import redis.asyncio as aioredis

from picker.kv.redis_index import RedisKvIndex
from picker.shared.tiers import StorageTier

GPU = StorageTier.GPU_HOT


def _index(**kw: object) -> RedisKvIndex:
    client = aioredis.Redis(host="127.0.0.1", port=1)  # never called here
    return RedisKvIndex(client, **kw)  # type: ignore[arg-type]


def test_writes_are_queued_in_order_and_removals_of_one_backend_coalesce() -> None:
    idx = _index(max_entries=1000)
    idx.put("a", [1, 2, 3], GPU)
    idx.remove("a", [3])
    idx.remove("a", [2])
    idx.remove("a", [99])  # not held: nothing to mirror
    idx.drop_backend("b")  # unknown locally: still mirrored (a fresh picker's snapshot)
    kinds = [(op.kind, op.backend, op.keys) for op in idx._queue]
    assert kinds == [("put", "a", [1, 2, 3]), ("del", "a", [3, 2]), ("drop", "b", [])]
    assert idx.stats.queued_keys == 3 + 2 + 1


def test_budget_evictions_are_mirrored_before_the_put_that_caused_them() -> None:
    idx = _index(max_entries=100)
    idx.put("a", list(range(100)), GPU)
    idx.put("b", [1000], GPU)  # full: "a" loses its oldest 10
    assert [(op.kind, op.backend, op.keys) for op in idx._queue][1:] == [
        ("del", "a", list(range(10))),
        ("put", "b", [1000]),
    ]


def test_a_full_queue_drops_counts_and_schedules_a_resync() -> None:
    idx = _index(max_entries=1000, queue_max_keys=5)
    idx.put("a", [1, 2, 3], GPU)
    idx.put("a", [4, 5, 6], GPU)  # 6 keys > 5: dropped
    assert idx.stats.writes_dropped == 1 and idx._resync_due
    assert not idx._queue and idx.stats.queued_keys == 0  # the resync rewrites everything
    idx.put("a", [7], GPU)  # until the resync ran: dropped too (counted), the local index has them all
    assert idx.stats.writes_dropped == 2
    assert idx.lookup([1, 2, 3, 4, 5, 6, 7])["a"].blocks == 7


async def test_while_down_holds_answers_from_the_local_index_without_a_redis_call() -> None:
    idx = _index()
    idx.put("a", [1, 2], GPU)
    idx.stats.up = False  # what a failed call or a failed ping leaves
    got = await idx.holds([1, 2, 3])
    assert got == idx.lookup([1, 2, 3]) and got["a"].blocks == 2
    assert idx.stats.fallbacks == 1 and idx.stats.lookups == 0 and idx.stats.errors == 0


def test_confirm_renews_the_ttl_at_most_once_per_tenth_of_it() -> None:
    idx = _index(ttl_seconds=100.0)
    idx.put("a", [1], GPU, now=0.0)
    for t in (1.0, 5.0, 9.0, 10.0, 12.0, 20.5):
        idx.confirm("a", now=t)
    touches = [op for op in idx._queue if op.kind == "touch"]
    assert len(touches) == 2  # at 1.0 and at 12.0 (≥ 1.0 + 10); 20.5 is before 12.0 + 10


def test_writes_while_down_are_dropped_but_queued_behind_a_running_resync() -> None:
    idx = _index()
    idx.stats.up = False
    idx.put("a", [1], GPU)
    assert idx.stats.writes_dropped == 1 and idx._resync_due and not idx._queue
    idx._resync_due, idx._recovering = False, True  # what _recover sets once Redis answers the ping
    idx.put("a", [2], GPU)
    assert idx.stats.writes_dropped == 1 and [op.keys for op in idx._queue] == [[2]]


def test_a_local_expiry_is_not_mirrored_and_the_redis_ttl_is_never_shorter_than_the_index_ttl() -> None:
    idx = _index(ttl_seconds=10.0)
    idx.put("a", [1], GPU, now=0.0)
    idx._queue.clear()
    assert idx.sweep_expired(now=20.0) == 1  # this picker's feed of "a" was silent: its local copy goes
    assert not idx._queue  # the shared copy stays: another picker's live feed may renew it
    assert idx.expirations("a") == 1  # its consumer resubscribes for a snapshot (which rewrites the hash)
    assert idx.ttl_ms == 11_000
    idx.put("b", [2], GPU)
    idx.drop_backend("b")  # a drop the feed says (a clear, a snapshot) is mirrored
    assert [op.kind for op in idx._queue] == ["put", "drop"]


def test_a_write_batch_holds_at_most_batch_max_keys_but_keeps_a_snapshot_whole() -> None:
    idx = _index(max_entries=1000, batch_max_keys=10)
    for k in range(1, 26):
        idx.put("a", [k], GPU)
    sizes = []
    while idx._queue:
        sizes.append(sum(len(op.keys) for op in idx._take_batch()))
    assert sizes == [10, 10, 5] and idx.stats.queued_keys == 0
    idx.drop_backend("b")  # a snapshot: its DEL and the puts queued with it go in one transaction
    for k in range(1, 16):
        idx.put("b", [k], GPU)
    idx.put("c", [1], GPU)
    first = idx._take_batch()
    assert [op.kind for op in first] == ["drop"] + ["put"] * 15  # past the cap: not cut inside the snapshot
    assert [(op.backend, op.keys) for op in idx._take_batch()] == [("c", [1])]
    assert idx.stats.queued_keys == 0


def test_a_full_client_pool_is_counted_but_never_takes_reads_off_redis() -> None:
    from redis.exceptions import ClusterDownError, MaxConnectionsError

    idx = _index()
    for _ in range(5):  # cluster mode: every connection to a node in use fails at once (not Redis's outage)
        idx._failed("read", MaxConnectionsError())
    assert idx.stats.up and idx.stats.errors == 5 and not idx.health.down
    idx._failed("write", MaxConnectionsError())  # a lost batch is still rebuilt
    assert idx._resync_due and idx.stats.up
    idx._failed("read", ClusterDownError("CLUSTERDOWN The cluster is down"))  # no primary for a slot: an outage
    assert not idx.stats.up and idx.health.down


def test_apply_args_encode_a_batch_for_the_cluster_script() -> None:
    from picker.kv.redis_layout import WriteOp, apply_args, pack_keys

    batch = [WriteOp("put", "a", [1, 2], b"g"), WriteOp("del", "a", [2]), WriteOp("drop", "b"), WriteOp("clear")]
    assert apply_args(batch, b"p:b:", 1100) == [
        b"p:b:", 1100,
        b"p", b"a", b"g" + pack_keys([1, 2]),
        b"d", b"a", pack_keys([2]),
        b"x", b"b", b"",
        b"c", b"", b"",
    ]  # fmt: skip
