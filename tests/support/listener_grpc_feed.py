"""The listener's gRPC feed server over one SGLang feed (e1, two keys a record, one subscriber), not started,
with a channel to it once it is."""

from __future__ import annotations

import grpc

from listener.config import FeedConfig, GrpcFeedConfig
from listener.feed import BackendFeed
from listener.grpc_feed import GrpcFeedServer
from listener.metrics import ListenerMetrics


class Served:
    def __init__(self, token_file: str | None = None) -> None:
        self.feed_cfg = FeedConfig(max_keys_per_record=2, max_subscribers_per_backend=1, keepalive_seconds=60)
        self.feeds = {"e1": BackendFeed("e1", self.feed_cfg, base_id=3 << 40, model="m", engine="sglang")}
        self.refusing = False
        self.server = GrpcFeedServer(
            self.feeds,
            GrpcFeedConfig(listen="127.0.0.1:0", token_file=token_file),
            self.feed_cfg,
            ListenerMetrics(),
            lambda: self.refusing,
        )

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")
