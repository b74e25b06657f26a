"""The gRPC feed consumer's own failures are counted and retried, never the end of the consumer."""

from __future__ import annotations

from pathlib import Path

from picker.config import EventSourceConfig
from picker.kv.feed_consumer import GrpcFeedConsumer, KvFeedConsumer, make_consumer
from picker.kv.index import InMemoryKvIndex
from tests.support.poll import async_wait_until


def test_the_scheme_picks_the_transport() -> None:
    idx = InMemoryKvIndex()
    sse = EventSourceConfig(backend_name="e1", endpoint="http://127.0.0.1:1/events/e1")
    grpcs = EventSourceConfig(backend_name="e1", endpoint="grpcs://listener:7818", token_file="/t", ca_file="/c")
    assert type(make_consumer(sse, idx)) is KvFeedConsumer
    c = make_consumer(grpcs, idx)
    assert isinstance(c, GrpcFeedConsumer) and c.secure and c.target == "listener:7818"


async def test_an_unreadable_ca_or_token_file_is_a_retried_failure(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    for kw in ({"ca_file": missing}, {"token_file": missing}):
        src = EventSourceConfig(backend_name="e1", endpoint="grpcs://127.0.0.1:1", reconnect_interval_ms=10, **kw)
        c = GrpcFeedConsumer(src, InMemoryKvIndex(), max_backoff_s=0.02)
        c.start()
        try:
            await async_wait_until(lambda c=c: c.stats.closes.get("FileNotFoundError", 0) >= 2)
            assert c._task is not None and not c._task.done()
        finally:
            await c.stop()


def test_grpc_fields_need_a_grpc_endpoint() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="grpc"):
        EventSourceConfig(backend_name="e1", endpoint="http://127.0.0.1:1/events/e1", token_file="/t")
    with pytest.raises(ValidationError, match="grpc://host:port"):
        EventSourceConfig(backend_name="e1", endpoint="grpc://listener/path")
