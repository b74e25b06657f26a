"""Listener configuration (``kv-listener run --config FILE``): pydantic models, every default here.

A bad key or value raises :class:`ListenerConfigError` naming its dotted path (``sources[0].engine``).

Sources are either a static list (``sources``) or follow the pool (``discovery``): each discovered backend
gets a source rendered from ``discovery.source_template`` (see :class:`SourceTemplate`), overridden per pod by
annotations. The two are mutually exclusive. How the listener uses them: docs/listener.md.
"""

from __future__ import annotations

import ipaddress
import re
import string
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from picker.shared.config_files import BackendName, ConfigError, read_yaml_mapping, validation_problems
from picker.shared.discovery import DiscoveredBackend
from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef

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
    # not: false is the seed's default behaviour (a GPU eviction removes the block).
    # See docs/operations.md#configuration.
    treat_eviction_as_offload: bool = False

    @model_validator(mode="after")
    def _endpoints_for_engine(self) -> SourceConfig:
        if self.engine == "trtllm":
            if not self.http_endpoint or not re.match(r"^https?://", self.http_endpoint):
                raise ValueError("engine trtllm needs http_endpoint (http:// or https:// URL)")
        elif not self.zmq_endpoint or not re.match(r"^(tcp|ipc|inproc)://", self.zmq_endpoint):
            raise ValueError(f"engine {self.engine} needs zmq_endpoint (tcp://, ipc:// or inproc://)")
        return self


# -- discovery: one source per discovered backend, rendered from a template ---------------------------------
PLACEHOLDERS = ("ip", "port", "rank", "pod", "namespace", "name")
# Per-pod overrides, each under DiscoveryConfig.annotation_prefix (kv-epp.io/zmq-endpoint, ...).
ANNOTATIONS = ("zmq-endpoint", "replay-endpoint", "http-endpoint", "model", "engine")
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "trtllm")
MAX_ANNOTATION_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SAMPLE = DiscoveredBackend(name="pod-0", ip="10.0.0.1", port=8000, rank=0, pod="pod-0", namespace="default")


class TemplateError(ValueError):
    """A discovered backend whose source cannot be made; ``kind`` is ``bad_annotation`` (a pod annotation is
    unusable) or ``bad_backend`` (the template does not give this backend a valid source)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _parse_template(template: str) -> list[tuple[str, str | None]]:
    """(literal text, placeholder or None) pieces; ValueError on a malformed or unknown placeholder, a format
    spec or a conversion (only the bare names of PLACEHOLDERS are accepted)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{template!r}: {exc} (write {{{{ and }}}} for literal braces)") from None
    out: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is not None and (name not in PLACEHOLDERS or spec or conversion):
            known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
            raise ValueError(f"{template!r}: unknown placeholder {{{name}}} (known: {known})")
        out.append((literal, name))
    return out


def placeholders(template: str) -> set[str]:
    """The placeholder names ``template`` uses (ValueError as for rendering)."""
    return {name for _, name in _parse_template(template) if name is not None}


def fill(template: str, values: dict[str, str]) -> str:
    """``template`` with its placeholders replaced by ``values`` (ValueError on a bad placeholder)."""
    return "".join(literal + (values[name] if name is not None else "") for literal, name in _parse_template(template))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` publishes on when the engine was given ``endpoint``: vLLM's and
    SGLang's ZmqEventPublisher offset it by the rank (``offset_endpoint_port`` in vllm/distributed/kv_events.py
    and sglang/srt/disaggregation/kv_events.py, applied to the publisher and the replay endpoint alike): a tcp
    port + rank, an ipc/inproc name + ``_dp<rank>``. ValueError when there is no port or it passes 65535."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"{endpoint!r}: no tcp port to offset by data-parallel rank {rank}")
    if int(port) + rank > 65_535:
        raise ValueError(f"{endpoint!r}: port + data-parallel rank {rank} passes 65535")
    return f"{head}:{int(port) + rank}"


def _values(b: DiscoveredBackend, bare_ip: bool) -> dict[str, str]:
    try:
        ip = ipaddress.ip_address(b.ip)
        host = ip.compressed if bare_ip or ip.version == 4 else f"[{ip.compressed}]"
    except ValueError:  # a host name (a backends file may give one)
        host = b.ip
    return {
        "ip": host,
        "port": str(b.port),
        "rank": str(b.rank),
        "pod": b.pod or b.name,
        "namespace": b.namespace,
        "name": b.name,
    }


class SourceTemplate(_Model):
    """The event source of every discovered backend (``discovery.source_template``).

    ``zmq_endpoint``, ``replay_endpoint``, ``http_endpoint``, ``topic`` and ``allowed_publishers`` take the
    placeholders ``{ip}`` (the pod IP; IPv6 in brackets, bare in ``allowed_publishers``), ``{port}`` (the pool's
    target port of this backend), ``{rank}`` (its index in ``targetPorts``: the data-parallel rank), ``{pod}``,
    ``{namespace}`` and ``{name}`` (the backend name). Data-parallel ranks: vLLM and SGLang offset the port of
    the publisher and the replay endpoint by the rank, so for rank i > 0 the rendered ``zmq_endpoint`` and
    ``replay_endpoint`` get port + i, unless the string uses ``{rank}`` or ``{port}`` (then it already says which
    port each rank has). Pod annotations ``<annotation_prefix>zmq-endpoint``, ``replay-endpoint`` (empty: none),
    ``http-endpoint``, ``model`` and ``engine`` override the template for that pod (same placeholders and rule).
    """

    engine: Engine = "vllm"
    model: str = Field(min_length=1, max_length=MAX_ANNOTATION_CHARS)
    block_size: int | None = Field(None, ge=1, le=65_536)  # informational, as in SourceConfig
    zmq_endpoint: str = "tcp://{ip}:5557"
    # The listener connects to each pod's publisher; bind mode (the engines connect to the listener) gives no
    # per-pod address to follow.
    zmq_mode: Literal["connect"] = "connect"
    topic: str = ""
    replay_endpoint: str | None = "tcp://{ip}:5558"
    replay_timeout_ms: int = Field(2000, ge=10, le=60_000)
    http_endpoint: str = "http://{ip}:{port}"  # engine trtllm
    poll_interval_ms: int = Field(200, ge=10, le=60_000)
    allowed_publishers: tuple[str, ...] = ()  # e.g. ["{ip}"]: only the pod itself may publish
    treat_eviction_as_offload: bool = False

    @field_validator("zmq_endpoint", "replay_endpoint", "http_endpoint", "topic")
    @classmethod
    def _known_placeholders(cls, v: str | None) -> str | None:
        if v is not None:
            placeholders(v)
        return v

    @field_validator("allowed_publishers")
    @classmethod
    def _known_placeholders_each(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for item in v:
            placeholders(item)
        return v

    @model_validator(mode="after")
    def _renders(self) -> SourceTemplate:
        try:
            self.render(_SAMPLE, "")
        except TemplateError as exc:
            raise ValueError(f"does not make a valid source (for pod IP 10.0.0.1, port 8000): {exc}") from None
        return self

    def render(self, b: DiscoveredBackend, annotation_prefix: str) -> SourceConfig:
        """The source of backend ``b`` (its pod's annotations under ``annotation_prefix`` override); raises
        :class:`TemplateError`."""
        ann: dict[str, str] = {}
        for key, value in b.annotations:
            short = key[len(annotation_prefix) :] if annotation_prefix and key.startswith(annotation_prefix) else ""
            if short in ANNOTATIONS:
                if len(value) > MAX_ANNOTATION_CHARS or _CONTROL.search(value):
                    raise TemplateError("bad_annotation", f"{key}: longer than {MAX_ANNOTATION_CHARS} or control chars")
                ann[short] = value.strip()
        kind = "bad_annotation" if ann else "bad_backend"
        engine = ann.get("engine", self.engine)
        if engine not in ENGINES:
            raise TemplateError("bad_annotation", f"{annotation_prefix}engine: {engine!r} is not one of {ENGINES}")
        model = ann.get("model", self.model)
        if not model:
            raise TemplateError("bad_annotation", f"{annotation_prefix}model: empty")
        values, bare = _values(b, bare_ip=False), _values(b, bare_ip=True)

        def endpoint(name: str, template: str | None, offset: bool) -> str | None:
            what = f"{annotation_prefix}{name}" if name in ann else f"source_template.{name.replace('-', '_')}"
            if name in ann:
                template = ann[name] or None  # an empty replay-endpoint annotation: no replay endpoint
            if template is None:
                return None
            try:
                out = fill(template, values)
                if offset and not placeholders(template) & {"rank", "port"}:
                    out = offset_endpoint(out, b.rank)
            except ValueError as exc:
                raise TemplateError("bad_annotation" if name in ann else "bad_backend", f"{what}: {exc}") from None
            return out

        fields: dict[str, Any] = {
            "backend_name": b.name,
            "engine": engine,
            "model": model,
            "block_size": self.block_size,
            "replay_timeout_ms": self.replay_timeout_ms,
            "poll_interval_ms": self.poll_interval_ms,
            "treat_eviction_as_offload": self.treat_eviction_as_offload,
        }
        try:
            fields["topic"] = fill(self.topic, values)
            fields["allowed_publishers"] = tuple(fill(p, bare) for p in self.allowed_publishers)
        except ValueError as exc:
            raise TemplateError("bad_backend", str(exc)) from None
        if engine == "trtllm":
            fields["http_endpoint"] = endpoint("http-endpoint", self.http_endpoint, offset=False)
        else:
            fields["zmq_endpoint"] = endpoint("zmq-endpoint", self.zmq_endpoint, offset=True)
            fields["replay_endpoint"] = endpoint("replay-endpoint", self.replay_endpoint, offset=True)
        try:
            return SourceConfig(**fields)
        except ValidationError as exc:
            problems = "; ".join(f"{path}: {msg}" for path, msg in validation_problems(exc))
            raise TemplateError(kind, problems) from None


class DiscoveryConfig(_Model):
    """The listener follows the pool: exactly one of ``inference_pool`` (a Kubernetes InferencePool) or
    ``backends_file``; one source per discovered backend, from ``source_template``. Bound: at most
    ``max_sources`` sources (and ``inference_pool.max_pods`` pods); backends beyond it, by name order, are skipped
    (logged, counted ``over_max_sources``)."""

    inference_pool: InferencePoolRef | None = None
    backends_file: BackendsFileRef | None = None
    annotation_prefix: str = Field("kv-epp.io/", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/$")
    max_sources: int = Field(1024, ge=1, le=100_000)
    source_template: SourceTemplate | None = Field(None, validate_default=True)

    @field_validator("backends_file")
    @classmethod
    def _one_source(cls, v: BackendsFileRef | None, info: ValidationInfo) -> BackendsFileRef | None:
        if v is not None and info.data.get("inference_pool") is not None:
            raise ValueError("inference_pool and backends_file are exclusive: set one")
        return v

    @field_validator("source_template")
    @classmethod
    def _template_required(cls, v: SourceTemplate | None) -> SourceTemplate | None:
        if v is None:
            raise ValueError("discovery needs a source_template (engine, model, endpoints)")
        return v

    @model_validator(mode="after")
    def _some_source(self) -> DiscoveryConfig:
        if self.inference_pool is None and self.backends_file is None:
            raise ValueError("discovery needs inference_pool or backends_file")
        return self

    @property
    def template(self) -> SourceTemplate:
        assert self.source_template is not None  # validated
        return self.source_template


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
    discovery: DiscoveryConfig | None = None  # instead of sources: follow the pool

    @field_validator("discovery")
    @classmethod
    def _sources_or_discovery(cls, v: DiscoveryConfig | None, info: ValidationInfo) -> DiscoveryConfig | None:
        if v is not None and info.data.get("sources"):
            raise ValueError("sources and discovery are exclusive: a static list or the discovered pool")
        return v

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
