"""Listener configuration (``kv-listener run --config FILE``): pydantic models, every default here.

A bad key or value raises :class:`ListenerConfigError` naming its dotted path (``sources[0].engine``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from picker.shared.config_files import BackendName, ConfigError, read_yaml_mapping, validation_problems

Engine = Literal["vllm", "sglang", "trtllm"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Model):
    """The seed's per-source memory limits (oldest-first pruning of individual blocks)."""

    max_tracked_blocks: int = Field(100_000, ge=1, le=50_000_000)
    max_retained_tokens: int = Field(16_777_216, ge=0, le=1 << 32)
    max_chain_tokens: int = Field(16_384, ge=1, le=1 << 24)
    # One event claiming more token ids than this is dropped as hostile (reason too_large).
    max_event_tokens: int = Field(1 << 20, ge=1, le=1 << 26)
    # ZMQ_MAXMSGSIZE: a larger message makes libzmq drop the peer connection. 8 MiB: a real batch holds one
    # scheduler step (at most max_num_batched_tokens tokens, ~5 bytes each, plus 9 bytes per hash), so
    # typically well under 1 MiB; 8 MiB keeps headroom for huge steps and page-size-1 removals.
    max_message_bytes: int = Field(8 << 20, ge=1024, le=1 << 31)
    # Decoding budget per message (hostile peers): arrays/maps built, and their elements in total. Past
    # either the payload is dropped (reason too_large) before it can take memory or time.
    max_message_containers: int = Field(1 << 18, ge=16, le=1 << 26)
    max_message_items: int = Field(1 << 21, ge=1024, le=1 << 28)
    # One event naming more block hashes than this is dropped as hostile (reason too_large).
    max_event_hashes: int = Field(1 << 18, ge=1, le=1 << 24)
    # Work unit of a decoded batch: block_chains.work_units splits it into slices of at most this many
    # blocks, so a source can yield to the event loop between slices.
    apply_slice_blocks: int = Field(1024, ge=1, le=1 << 24)  # ~2-3 ms of tracker work (page size 1)
    # Engine messages received but not yet applied, in bytes; past it new messages are dropped (a sequence
    # gap, repaired by replay) so a flood cannot grow memory.
    max_backlog_bytes: int = Field(64 << 20, ge=1 << 16, le=1 << 34)


class SourceConfig(_Model):
    """One engine replica's event source; ``backend_name`` is the picker's endpoint name."""

    backend_name: BackendName
    engine: Engine = "vllm"
    model: str
    # Informational only: the tracker takes each event's page size from the event itself (vLLM block_size,
    # SGLang page size, 1 included) and regroups pages into the feed's key blocks (ListenerConfig.key_block_size).
    block_size: int | None = Field(None, ge=1, le=65_536)
    # ZMQ (vllm, sglang)
    zmq_endpoint: str | None = None
    zmq_mode: Literal["connect", "bind"] = "connect"  # bind when the engine's publisher connects
    topic: str = ""
    replay_endpoint: str | None = None
    replay_timeout_ms: int = Field(2000, ge=10, le=60_000)
    # HTTP (trtllm): base URL of trtllm-serve; the poller POSTs {url}/kv_cache_events
    http_endpoint: str | None = None
    poll_interval_ms: int = Field(200, ge=10, le=60_000)
    allowed_publishers: tuple[str, ...] = ()  # empty = any; ZMQ peer IP / TRT-LLM URL host
    # The seed's true acts only under storage_offloading.enabled (default false), a switch the listener has
    # not: false is the seed's default behaviour (a GPU eviction removes the block). See README.
    treat_eviction_as_offload: bool = False

    @model_validator(mode="after")
    def _endpoints_for_engine(self) -> SourceConfig:
        if self.engine == "trtllm":
            if not self.http_endpoint or not re.match(r"^https?://", self.http_endpoint):
                raise ValueError("engine trtllm needs http_endpoint (http:// or https:// URL)")
        elif not self.zmq_endpoint or not re.match(r"^(tcp|ipc|inproc)://", self.zmq_endpoint):
            raise ValueError(f"engine {self.engine} needs zmq_endpoint (tcp://, ipc:// or inproc://)")
        return self


class FeedConfig(_Model):
    """Bounds of the listener→picker stream."""

    history_size: int = Field(16_384, ge=16, le=10_000_000)  # records kept per backend for resume
    subscriber_queue_size: int = Field(4_096, ge=1, le=1_000_000)  # records queued per subscriber
    max_keys_per_record: int = Field(2_048, ge=1, le=20_000)  # keeps every record far below 1 MiB
    keepalive_seconds: float = Field(15.0, gt=0, le=3600)
    write_timeout_seconds: float = Field(10.0, gt=0, le=600)
    # Bytes of live records queued per subscriber (8 per key + 48 per record); past it: buffer_overflow.
    subscriber_queue_bytes: int = Field(16 << 20, ge=1 << 12, le=1 << 34)
    # Subscribers (SSE and gRPC together) per backend and in all; one more is refused (503 / RESOURCE_EXHAUSTED).
    max_subscribers_per_backend: int = Field(64, ge=1, le=100_000)
    max_subscribers: int = Field(256, ge=1, le=1_000_000)


class GrpcFeedConfig(_Model):
    """The feed as the gRPC service kvfeed.v1.KvFeed on its own port (off unless ``listen`` is set)."""

    listen: str | None = None  # host:port, e.g. "0.0.0.0:7818"
    tls_cert_file: str | None = None  # PEM; with tls_key_file: TLS (grpcs://), else plaintext
    tls_key_file: str | None = None
    token_file: str | None = None  # every call must carry "authorization: Bearer <file content>"

    @model_validator(mode="after")
    def _valid(self) -> GrpcFeedConfig:
        if self.listen is not None:
            host, sep, port = self.listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65_535:
                raise ValueError("grpc.listen must be host:port")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("grpc.tls_cert_file and grpc.tls_key_file go together")
        return self


class StateConfig(_Model):
    """Restart-proof state: per ZMQ source, a compacted log of the engine's own event payloads and the last
    applied seq (+ digest), written atomically every ``interval_seconds`` and at stop. ``path`` None = off."""

    path: str | None = None
    interval_seconds: float = Field(5.0, ge=0.05, le=3600)
    # Bound of the state file; a source whose compacted log does not fit is saved without it (restored empty).
    max_bytes: int = Field(256 << 20, ge=1 << 16, le=1 << 34)


class ListenerConfig(_Model):
    """Top level of the listener's YAML file."""

    listen: str = "127.0.0.1:7817"  # SSE feed, /metrics, /healthz
    # The block size of the keys in the feed: the listener regroups each engine's pages (any size, 1
    # included) into blocks of this many tokens. Must equal the picker's kv_cache_index.tokenizer.block_size.
    key_block_size: int = Field(16, ge=1, le=4096)
    # SIGTERM: /readyz answers 503 this long before new feed subscriptions are refused.
    drain_propagation_seconds: float = Field(1.0, ge=0, le=60)
    drain_deadline_seconds: float = Field(5.0, ge=0, le=600)
    limits: LimitsConfig = LimitsConfig()
    feed: FeedConfig = FeedConfig()
    state: StateConfig = StateConfig()
    # /healthz: a connected source with no event for this long is "stale"; one not connected this long
    # after start (or after losing its peer) makes the status "degraded".
    stale_after_seconds: float = Field(300.0, gt=0, le=86_400)
    connect_grace_seconds: float = Field(10.0, ge=0, le=3600)
    grpc: GrpcFeedConfig = GrpcFeedConfig()
    sources: tuple[SourceConfig, ...] = ()

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65_535:
            raise ValueError("listen must be host:port")
        return v

    @model_validator(mode="after")
    def _unique_backends(self) -> ListenerConfig:
        names = [s.backend_name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate backend_name: {', '.join(dup)}")
        return self

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class ListenerConfigError(ConfigError):
    """An unusable listener config; ``problems`` are (dotted path, message) pairs."""


def parse_listener_config(data: dict[str, Any]) -> ListenerConfig:
    """Validate a mapping; raise ListenerConfigError naming every bad key's dotted path."""
    try:
        return ListenerConfig(**data)
    except ValidationError as exc:
        raise ListenerConfigError(validation_problems(exc)) from None
    except TypeError as exc:  # a key that is not a string (read_yaml_mapping refuses those already)
        raise ListenerConfigError([("<root>", f"section names must be strings ({exc})")]) from None


def load_listener_config(path: str | Path) -> ListenerConfig:
    """Load and validate the YAML file at ``path``."""
    try:
        data = read_yaml_mapping(path)
    except ConfigError as exc:
        raise ListenerConfigError(exc.problems) from None
    return parse_listener_config(data)
