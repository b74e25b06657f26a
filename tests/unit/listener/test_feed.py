"""listener.feed: its bounds (pending records, subscribers, one batch), shared snapshots, ids that a new process
never takes for an old one's, the retirement of a backend that left the pool (a clear, then the end of the
stream), and the two transports' parity (the picker's SSE and gRPC consumers build the same index)."""

from __future__ import annotations

import pytest

from listener.config import FeedConfig
from listener.feed import BackendFeed, Record, Subscriber, SubscriberLimit, open_subscription
from picker.config import EventSourceConfig
from picker.kv.feed_consumer import KvFeedConsumer
from picker.kv.grpc_feed_consumer import GrpcFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.shared.feed_records import CLEAR, PUT, SNAPSHOT_BEGIN, SNAPSHOT_END, SseParser


def feed(**kw: int) -> BackendFeed:
    return BackendFeed("e1", FeedConfig(**{"history_size": 64, "max_keys_per_record": 4, **kw}), base_id=1000)


async def drain(sub: Subscriber) -> list[Record]:
    out: list[Record] = []
    async for batch in sub.batches(keepalive_seconds=3600):
        out.extend(batch)
        if not sub.replay and not sub.pending and sub.snapshot is None and out and out[-1].id is not None:
            break
    return out


def test_pending_records_are_bounded_in_bytes() -> None:
    f = feed(subscriber_queue_size=1000, subscriber_queue_bytes=4096)
    sub = f.subscribe(f.last_id)
    for i in range(20):
        f.emit("put", list(range(i * 4, i * 4 + 4)), "gpu_hot")  # 80 bytes counted per record
    assert sub.close_reason is None and sub.pending_bytes <= 4096
    for i in range(100):
        f.emit("put", list(range(i * 4, i * 4 + 4)), "gpu_hot")
    assert sub.close_reason == "buffer_overflow" and sub not in f.subscribers and not sub.pending


def test_subscriber_caps_per_backend_and_in_all() -> None:
    cfg = FeedConfig(max_subscribers_per_backend=2, max_subscribers=3)
    feeds = {"a": BackendFeed("a", cfg), "b": BackendFeed("b", cfg)}
    open_subscription(feeds, "a", None)
    open_subscription(feeds, "a", None)
    with pytest.raises(SubscriberLimit):
        open_subscription(feeds, "a", None)
    open_subscription(feeds, "b", None)
    with pytest.raises(SubscriberLimit):
        open_subscription(feeds, "b", None)  # 3 in all
    with pytest.raises(KeyError):
        open_subscription(feeds, "c", None)


async def test_snapshots_are_shared_while_the_history_bridges_them() -> None:
    f = feed()
    f.emit("put", list(range(10)), "gpu_hot")
    s1 = f.subscribe(None)
    f.emit("del", [3], None)
    f.emit("put", [100], "storage_warm")
    s2 = f.subscribe(None)  # same snapshot + the 2 records after it
    assert f.snapshots_built == 1 and s2.snapshot is s1.snapshot and len(s2.replay) == 2
    held: dict[int, str] = {}
    for rec in await drain(s2):
        if rec.kind == "put":
            held.update(dict.fromkeys(rec.keys or (), rec.text))
        elif rec.kind == "del":
            for k in rec.keys or ():
                held.pop(k, None)
    assert held == f.state
    for i in range(40):  # past history_size // 2 records since the snapshot: a new one
        f.emit("put", [1000 + i], "gpu_hot")
    f.subscribe(None)
    assert f.snapshots_built == 2


async def test_sse_and_grpc_records_build_the_same_index() -> None:
    f = feed()
    f.emit("put", list(range(1, 11)), "gpu_hot")
    sub = f.subscribe(None)
    f.emit("del", [2, 3], None)
    f.emit("put", [2**64 - 1, 77], "storage_warm")
    f.clear("restart")
    f.emit("put", [5, 6, 7], "gpu_hot")
    records = await drain(sub)
    i_sse, i_pb = InMemoryKvIndex(), InMemoryKvIndex()
    sse = KvFeedConsumer(EventSourceConfig(backend_name="e1", endpoint="http://127.0.0.1:1/events/e1"), i_sse)
    grpc_c = GrpcFeedConsumer(EventSourceConfig(backend_name="e1", endpoint="grpc://127.0.0.1:1"), i_pb)
    parser = SseParser()
    for rec in records:
        for event, data, rec_id in parser.feed(rec.sse()):
            sse.apply_record(event, data, rec_id)
        grpc_c.apply_message(rec.pb())
    keys = [1, 2, 3, 4, 5, 6, 7, 77, 2**64 - 1]
    held_sse = {k for k in keys if i_sse.lookup([k]).get("e1")}
    held_pb = {k for k in keys if i_pb.lookup([k]).get("e1")}
    assert held_sse == held_pb == {5, 6, 7}
    assert sse.last_event_id == grpc_c.last_event_id == f.last_id
    assert sse.stats.snapshots == grpc_c.stats.snapshots == 1


async def test_one_batch_is_bounded_in_bytes() -> None:
    from listener.feed import MAX_BATCH_BYTES

    f = feed(max_keys_per_record=2048)
    sub = f.subscribe(f.last_id)
    f.emit("put", list(range(40 * 2048)), "gpu_hot")  # 40 records of 16 KiB of keys
    batches = sub.batches(keepalive_seconds=3600)
    first = await anext(batches)
    assert 1 < len(first) < 40 and sum(r.size for r in first) <= MAX_BATCH_BYTES
    await batches.aclose()


def test_a_new_process_never_resumes_an_old_process_id() -> None:
    """Found in review: ids started at the wall clock in µs, so a listener restarted after a clock step back
    (or one that published more records than µs passed) could take an old process's id for one of its own
    and resume a subscriber at the wrong place. Ids now start at a random per-process epoch."""
    cfg = FeedConfig(history_size=64, max_keys_per_record=4)
    old = BackendFeed("e1", cfg)
    for k in range(10):
        old.emit("put", [k], "gpu_hot")
    new = BackendFeed("e1", cfg)
    for k in range(10):
        new.emit("put", [k], "gpu_hot")
    assert old.last_id >> 40 != new.last_id >> 40 or old.last_id == new.last_id  # distinct epochs (2^-22 equal)
    sub = new.subscribe(old.last_id - 3)
    assert not sub.resumed  # a snapshot, not the other process's records
    new.unsubscribe(sub)


# -- the feed of a backend that left the pool -------------------------------------------------------------------
async def test_retire_mid_snapshot_skips_the_rest_and_ends_after_the_clear() -> None:
    feed = BackendFeed("a", FeedConfig(max_keys_per_record=2, history_size=16), base_id=1 << 40)
    feed.emit(PUT, list(range(1, 11)), "gpu_hot")  # 10 keys: a 5-chunk snapshot
    sub = feed.subscribe(None)
    it = sub.batches(keepalive_seconds=60)
    first = await anext(it)
    assert first[0].kind == SNAPSHOT_BEGIN
    assert (await anext(it))[0].kind == PUT
    feed.retire("backend_gone")
    clear_id = feed.last_id
    feed.emit(PUT, [99], "gpu_hot")  # a late record of the stopping source reaches nobody
    rest = [batch async for batch in it]
    kinds = [r.kind for batch in rest for r in batch]
    assert kinds == [CLEAR] and rest[0][0].text == "backend_gone" and rest[0][0].id == clear_id
    assert SNAPSHOT_END not in kinds and sub.close_reason == "backend_gone"


async def test_retire_replaces_pending_live_records_with_the_clear() -> None:
    feed = BackendFeed("a", FeedConfig(), base_id=5 << 40)
    sub = feed.subscribe(feed.last_id)  # resumed: no snapshot
    feed.emit(PUT, [1, 2], "gpu_hot")
    feed.emit(PUT, [3], "gpu_hot")
    feed.retire("backend_gone")
    batches = [batch async for batch in sub.batches(keepalive_seconds=60)]
    assert [[r.kind for r in b] for b in batches] == [[CLEAR]]
    assert sub.close_reason == "backend_gone"


# -- resume and keepalives ----------------------------------------------------------------------------------------
async def test_a_subscriber_resumes_while_the_history_bridges_its_id() -> None:
    f = feed(history_size=16)
    f.emit(PUT, [1, 2, 3, 4, 5], "gpu_hot")  # two records (4 keys per record)
    mark = f.last_id
    f.emit("del", [1], None)
    f.emit(PUT, [9], "storage_warm", page=32)
    sub = f.subscribe(mark)
    assert sub.resumed and sub.snapshot is None and [r.kind for r in sub.replay] == ["del", PUT]
    assert sub.replay[-1].num == 32 and sub.initial_records == 2  # a put carries its store's page size
    for i in range(20):  # the history (16 records) no longer holds the record after mark
        f.emit(PUT, [100 + i], "gpu_hot")
    late = f.subscribe(mark)
    assert not late.resumed and late.snapshot is not None and late.snapshot.entries == len(f.state)
    assert f.subscribe(f.last_id + 5).snapshot is not None  # an id from the future: a snapshot


async def test_an_idle_subscriber_gets_keepalives_and_close_all_ends_it() -> None:
    f = feed()
    sub = f.subscribe(f.last_id)
    batches = sub.batches(keepalive_seconds=0.01)
    assert await anext(batches) == []  # nothing to send: a keepalive is due
    f.close_all("draining")
    assert [b async for b in batches] == [] and sub.close_reason == "draining"
