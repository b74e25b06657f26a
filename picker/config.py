"""Typed configuration: one YAML file, the seed's section names, every default in one place.

Precedence: environment (``KV_EPP_<SECTION>__<KEY>``) over the YAML file over the defaults below.
Hot-reloadable sections are listed in ``HOT_RELOADABLE``; a change elsewhere is reported as
"restart required" and not half-applied.

One module on purpose, the picker's largest: it is the settings schema, one class per section, and its keys and
class docstrings feed the chart's generated values schema (``charts/generate.py``); splitting it would scatter
the one place every default lives. See docs/picker.md, "Module map".
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from picker.shared.config_files import BackendName, ConfigError, read_yaml_mapping, validation_problems
from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef
from picker.shared.discovery.kube_objects import MAX_REWRITE_RULES, MAX_REWRITE_WEIGHT, MAX_RULE_ITEMS, MODEL_NAME_MAX

STRATEGIES = (
    "RoundRobin",
    "WeightedRoundRobin",
    "LeastLatency",
    "LeastRequest",
    "Random",
    "ConsistentHash",
    "PrefixAwareHash",
    "PrefixMemory",
)
StrategyName = Literal[
    "RoundRobin",
    "WeightedRoundRobin",
    "LeastLatency",
    "LeastRequest",
    "Random",
    "ConsistentHash",
    "PrefixAwareHash",
    "PrefixMemory",
]
HOT_RELOADABLE = frozenset(
    {
        "prefix_routing", "selection_strategy", "pool", "session_affinity", "admission", "response_cache",
        "flow_control", "experiments", "model_rewrites", "metrics", "disaggregation",
    }
)  # fmt: skip
# keys of hot-reloadable sections that are not: where the pool comes from (the discovery task is started once),
# the response cache's store and its Redis connection (the pool is built once)
RESTART_REQUIRED_KEYS = (
    ("pool", "inference_pool"),
    ("pool", "backends_file"),
    ("response_cache", "backend"),
    ("response_cache", "redis"),
    ("flow_control", "watch_objectives"),  # the InferenceObjective watch is started (or not) at start
)
MAX_MODEL_REWRITES = 1000  # the config's model_rewrites (as many as the watch keeps)
ENV_PREFIX = "KV_EPP_"
ENV_NESTED_DELIMITER = "__"
NOT_IMPLEMENTED = "accepted, not implemented yet"
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token


def _header_name(v: str) -> str:
    if not HEADER_NAME_RE.fullmatch(v):
        raise ValueError("must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefixRoutingConfig(_Section):
    """Tier 1: prefix-aware sticky routing (seed defaults).

    The ``memory_*`` keys are read by the ``PrefixMemory`` strategy only: how many prefix keys it
    remembers (LRU), on how many endpoints per key (the least recently placed dropped), and the looser
    CHWBL epsilon a key's holders may reach before the key is copied to a new endpoint (a value below
    ``load_factor_epsilon`` acts as ``load_factor_epsilon``)."""

    enabled: bool = False
    max_prefix_length: int = Field(1024, ge=1, le=1 << 20)
    load_factor_epsilon: float = Field(0.25, ge=0.01, le=10.0)
    virtual_nodes: int = Field(150, ge=1, le=10_000)
    anthropic_cache_control_injection: bool = False
    memory_max_entries: int = Field(65_536, ge=1, le=10_000_000)
    memory_max_holders: int = Field(4, ge=1, le=64)
    memory_load_factor_epsilon: float = Field(0.5, ge=0.01, le=10.0)


class CostModelConfig(_Section):
    """Tier 4's cost model: the estimated time to first token on each endpoint,

        base_ms + prefill_ms_per_token * (queued prefill tokens + this request's uncached tokens + waste)
                + queue_ms_per_request * requests queued there + decode_ms_per_seq * requests decoding there

    The four coefficients start at these priors and are fitted online to the observed prefill times
    (``calibrate``; ``picker.pool.calibration``); no constant needs tuning per workload."""

    calibrate: bool = True
    # the per-token prior becomes the engines' own measured prefill cost (vLLM's /metrics, read by the engine
    # signals scraper) once enough finished requests back it (``picker.pool.calibration.EnginePrefillFit``)
    prior_from_engine: bool = True
    prior_base_ms: float = Field(10.0, ge=0.0, le=60_000.0)
    prior_prefill_ms_per_token: float = Field(0.1, gt=0.0, le=100.0)
    prior_decode_ms_per_seq: float = Field(0.5, ge=0.0, le=10_000.0)
    prior_queue_ms_per_request: float = Field(20.0, ge=0.0, le=60_000.0)
    # until requests are counted: the uncached tokens of a request (turns an engine's queue into tokens)
    prior_mean_prefill_tokens: float = Field(1000.0, ge=0.0, le=1_000_000.0)
    # a hit in CPU/storage tier (StorageWarm) still costs this fraction of the prefill of those tokens
    storage_warm_cost_fraction: float = Field(0.3, ge=0.0, le=1.0)
    # endpoints within this fraction of the cheapest count as tied: the one holding the most of the prefix
    # wins, then the cheapest, then a rendezvous hash of the prefix (pickers place a new prefix alike)
    near_tie_fraction: float = Field(0.1, ge=0.0, le=1.0)
    # weight of the delay that re-prefilling a prefix another endpoint holds imposes on the requests queued in
    # the pool (1: each counts as much as this request; 0: only this request's TTFT counts, and a loaded
    # holder's prefix is replicated as soon as that is faster for this one request)
    others_delay_weight: float = Field(1.0, ge=0.0, le=100.0)
    # an endpoint whose engine evicted blocks within this window has a full cache: a new copy of a prefix
    # there also evicts another prefix, so its waste is charged as if the pool's mean queue waited there
    eviction_window_seconds: float = Field(60.0, ge=0.0, le=86_400.0)
    # LoRA affinity (requests whose model is a LoRA adapter): an endpoint's llm-d score (1 adapter running, 0.8
    # free slot, 0.6 adapter waiting, 0 none) costs (1 - score) x this many key blocks of prefill there. Below
    # one block, so holding even one more block of the prompt outweighs it: the cache decides, the adapter's
    # slots break what it leaves even (docs/llm-d-compat.md, "LoRA"). 0: off.
    lora_affinity_blocks: float = Field(0.75, ge=0.0, le=10_000.0)
    # a copy of a prefix held elsewhere serves that prefix's requests over about this horizon: its prefill is
    # shared among them (rate × horizon ÷ holders); 0 charges every copy in full to the request that makes it
    copy_horizon_seconds: float = Field(10.0, ge=0.0, le=3600.0)


class ScoringConfig(_Section):
    """Tier 4 scoring. ``mode``: ``cost`` (default) picks the least estimated time to first token over every
    eligible endpoint (``cost``); ``overlap`` is the seed's composite score over the holders (weights below,
    seed defaults, the three main weights sum to 1.0)."""

    mode: Literal["cost", "overlap"] = "cost"
    cost: CostModelConfig = CostModelConfig()
    overlap_weight: float = Field(0.6, ge=0.0, le=1.0)
    load_weight: float = Field(0.3, ge=0.0, le=1.0)
    health_weight: float = Field(0.1, ge=0.0, le=1.0)
    min_overlap_threshold: float = Field(0.3, ge=0.0, le=1.0)
    gpu_tier_weight: float = Field(1.0, ge=0.0, le=1.0)
    storage_tier_weight: float = Field(0.6, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _weights_sum_to_one(self) -> ScoringConfig:
        total = self.overlap_weight + self.load_weight + self.health_weight
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"overlap_weight + load_weight + health_weight must sum to 1.0, got {total:.4f}")
        return self


class StorageOffloadingConfig(_Section):
    enabled: bool = False
    treat_eviction_as_offload: bool = True


class EventSourceConfig(_Section):
    """One listener feed the picker subscribes to (one per backend)."""

    backend_name: BackendName
    endpoint: str
    reconnect_interval_ms: int = Field(1000, ge=10, le=600_000)
    read_timeout_ms: int = Field(45_000, ge=100, le=3_600_000)  # > the listener's keepalive (15 s)
    # gRPC feed (endpoint grpc://host:port or grpcs://host:port; the backend subscribed is backend_name):
    ca_file: str | None = None  # grpcs: PEM bundle that signs the listener's certificate (default: system roots)
    token_file: str | None = None  # sent as "authorization: Bearer <file content>", re-read at each connect

    @field_validator("endpoint")
    @classmethod
    def _valid_scheme(cls, v: str) -> str:
        if not re.match(r"^(https?)://", v) and not re.fullmatch(r"grpcs?://[^/\s]+:\d{1,5}/?", v):
            raise ValueError(
                "endpoint must be an http:// or https:// URL of the listener's SSE feed, "
                "or grpc://host:port / grpcs://host:port of its gRPC feed"
            )
        return v

    @model_validator(mode="after")
    def _grpc_only_fields(self) -> EventSourceConfig:
        if not self.endpoint.startswith("grpc") and (self.ca_file or self.token_file):
            raise ValueError("ca_file and token_file apply to a grpc:// or grpcs:// endpoint only")
        return self


BACKEND_PLACEHOLDER = "{name}"


class EventSourceTemplate(_Section):
    """The listener feed of every backend of a discovered pool (``pool.inference_pool`` or
    ``pool.backends_file``): an ``event_sources`` entry without ``backend_name``, which comes from each
    discovered backend. An SSE ``endpoint`` names the backend with ``{name}`` (e.g.
    ``http://127.0.0.1:7817/events/{name}``); a ``grpc://host:port`` or ``grpcs://host:port`` endpoint takes no
    placeholder (the subscription names the backend)."""

    endpoint: str
    reconnect_interval_ms: int = Field(1000, ge=10, le=600_000)
    read_timeout_ms: int = Field(45_000, ge=100, le=3_600_000)
    ca_file: str | None = None
    token_file: str | None = None

    @model_validator(mode="after")
    def _renders(self) -> EventSourceTemplate:
        grpc_endpoint = self.endpoint.startswith(("grpc://", "grpcs://"))
        if grpc_endpoint and BACKEND_PLACEHOLDER in self.endpoint:
            raise ValueError("a grpc:// or grpcs:// endpoint takes no {name}: the subscription names the backend")
        if not grpc_endpoint and BACKEND_PLACEHOLDER not in self.endpoint:
            raise ValueError(
                "an http(s) endpoint must contain {name} (the backend's feed path, e.g. /events/{name}): "
                "without it every backend would read the same feed"
            )
        try:
            self.for_backend("backend-0")
        except ValidationError as exc:
            raise ValueError("; ".join(m.removeprefix("Value error, ") for _, m in validation_problems(exc))) from None
        return self

    def for_backend(self, name: str) -> EventSourceConfig:
        """The event source of backend ``name`` (a valid backend name: checked where it is discovered)."""
        return EventSourceConfig(
            backend_name=name,
            endpoint=self.endpoint.replace(BACKEND_PLACEHOLDER, name),
            reconnect_interval_ms=self.reconnect_interval_ms,
            read_timeout_ms=self.read_timeout_ms,
            ca_file=self.ca_file,
            token_file=self.token_file,
        )


class TokenizerConfig(_Section):
    """Where the picker gets a request's token ids for Tier 4 block keys, and the tokenization cache
    (``picker.kv.token_cache``) that keeps the tokenizer off the request path for a seen prefix.

    A request that waits for the tokenizer waits at most ``timeout_ms + timeout_ms_per_kib × body KiB``,
    capped at ``max(timeout_max_ms, timeout_ms)`` (a background fill waits up to the cap)."""

    source: Literal["engine", "local", "none"] = "engine"
    timeout_ms: int = Field(50, ge=1, le=10_000)  # the wait for an empty body; grows with the body's size
    timeout_ms_per_kib: float = Field(1.0, ge=0, le=1_000)  # ms more per KiB of request body
    timeout_max_ms: int = Field(1_000, ge=1, le=60_000)  # the cap (at least timeout_ms), also the fills' wait
    block_size: int = Field(16, ge=1, le=4096)
    local_path: str | None = None  # tokenizer.json for source=local
    chat_template_path: str | None = None
    max_concurrency: int = Field(64, ge=1, le=10_000)
    endpoint: str | None = None  # base URL for source=engine; default: a healthy backend of the pool
    max_prefix_tokens: int = Field(16_384, ge=1, le=1 << 20)  # block keys computed for this many tokens at most
    # the tokenization cache: token ids at message (and prompt-chunk) boundaries, LRU, bounded by bytes; 0 = off
    cache_max_bytes: int = Field(64 << 20, ge=0, le=1 << 36)
    cache_min_fraction: float = Field(0.5, ge=0, le=1)  # a cached prefix this share of the prompt skips the call
    cache_trust_after: int = Field(2, ge=0, le=1_000_000)  # confirmed prefixes before a model's prefixes are used
    fill_queue_size: int = Field(256, ge=1, le=100_000)  # background tokenizations waiting; more are dropped
    fill_queue_max_bytes: int = Field(64 << 20, ge=1 << 10, le=1 << 34)  # their text, bounded too
    fill_workers: int = Field(2, ge=1, le=64)  # background tokenizations at once

    @property
    def timeout_cap_ms(self) -> int:
        """The longest wait for the tokenizer (an older config's larger ``timeout_ms`` still counts)."""
        return max(self.timeout_max_ms, self.timeout_ms)


class FeedChecksConfig(_Section):
    """Tier 4's truth checks: a feed that stops while its backend serves traffic, and a start-up probe
    that compares the picker's block keys with what the listener derived for the same prompt."""

    stale_after_seconds: float = Field(60.0, gt=0, le=86_400)  # no feed record for this long ...
    stale_after_requests: int = Field(20, ge=1, le=1_000_000)  # ... while this many responses were served
    self_check: bool = True  # probe every backend with a feed once its feed is connected
    self_check_model: str | None = None  # the probe's model; default: the model the listener keys with
    self_check_timeout_seconds: float = Field(15.0, gt=0, le=600)
    # readiness waits for each live backend's feed to catch up (its initial snapshot or resume applied) at most
    # this long after the backend appeared; then it counts as stale and readiness stops waiting for it
    ready_grace_seconds: float = Field(10.0, ge=0, le=3600)


class KvCacheIndexConfig(_Section):
    """Tier 4: the precise KV index (restart-required section)."""

    enabled: bool = False
    backend: Literal["memory", "redis"] = "memory"  # redis: accepted, warned about, the in-memory index is used
    max_entries: int = Field(100_000, ge=100, le=10_000_000)
    entry_ttl_seconds: int = Field(600, ge=1, le=86_400)
    scoring: ScoringConfig = ScoringConfig()
    storage_offloading: StorageOffloadingConfig = StorageOffloadingConfig()
    event_sources: tuple[EventSourceConfig, ...] = ()  # a static pool's feeds, one per backend
    event_source_template: EventSourceTemplate | None = None  # a discovered pool's feed, for every backend
    tokenizer: TokenizerConfig = TokenizerConfig()
    # A request's model → the (base model, LoRA adapter) the engine keys its blocks with. ``lora_adapters``:
    # adapter name (what a request sends as ``model``) → its base model; ``model_aliases``: another name a
    # request may use (vLLM --served-model-name) → the model the listener's source is configured with.
    lora_adapters: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    model_aliases: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    checks: FeedChecksConfig = FeedChecksConfig()
    # the block keys of requests this picker just sent, counted as held by their endpoint until the KV events
    # arrive (``picker.kv.placements``); 0 turns it off
    recent_placements_seconds: float = Field(30.0, ge=0.0, le=3600.0)
    recent_placements_max_entries: int = Field(200_000, ge=1_000, le=10_000_000)


class BackendConfig(_Section):
    """A static backend (model-server replica)."""

    name: BackendName
    type: Literal["engine"] = "engine"
    address: str
    weight: int = Field(1, ge=1, le=1000)
    # P/D (docs/pd.md): decode takes whole requests (with disaggregation, at its routing sidecar's address); prefill
    # is only named in x-prefiller-host-port, never sent a whole request; both is either
    role: Literal["prefill", "decode", "both"] = "decode"

    @field_validator("address")
    @classmethod
    def _valid_address(cls, v: str) -> str:
        return _ip_port(v)


GEMINI_DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"


class GeminiBackendConfig(_Section):
    """A backend of ``type: gemini``: Google's Generative Language API (an external host; it publishes no KV
    events). A request whose ``model`` is in ``models`` goes to it through Envoy's cluster for ``base_url``'s
    host (TLS, SNI, DNS for this host alone). The API key is read from ``api_key_file`` (a mounted Secret), never
    from the config or the environment, and never logged. ``http://`` only with ``allow_insecure`` (a local fake
    in tests). See docs/gemini.md."""

    name: BackendName
    type: Literal["gemini"]
    base_url: str = GEMINI_DEFAULT_BASE_URL
    api_key_file: str = Field(min_length=1)
    models: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(min_length=1, max_length=1000)
    allow_insecure: bool = False

    @model_validator(mode="after")
    def _valid_url(self) -> GeminiBackendConfig:
        u = urllib.parse.urlsplit(self.base_url)
        if u.scheme not in ("https", "http") or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
            raise ValueError("base_url must be https://HOST[:PORT] (no path, query or fragment)")
        if u.scheme == "http" and not self.allow_insecure:
            raise ValueError("base_url is http://: the API key would travel in clear text (allow_insecure: true is "
                             "for a local fake in tests)")  # fmt: skip
        return self

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.base_url).hostname or ""

    @property
    def port(self) -> int:
        u = urllib.parse.urlsplit(self.base_url)
        return u.port or (443 if u.scheme == "https" else 80)

    @property
    def tls(self) -> bool:
        return urllib.parse.urlsplit(self.base_url).scheme == "https"


def _backend_type(v: Any) -> str:
    t = v.get("type", "engine") if isinstance(v, dict) else getattr(v, "type", "engine")
    return "type=gemini" if t == "gemini" else "type=engine"  # an unknown type: BackendConfig names the key


AnyBackend = Annotated[
    Annotated[BackendConfig, Tag("type=engine")] | Annotated[GeminiBackendConfig, Tag("type=gemini")],
    Discriminator(_backend_type),
]


def _ip_port(v: str) -> str:
    """``ip:port`` (IPv6 in brackets), returned in canonical form. A DNS name is refused, not resolved: the
    generated Envoy's cluster holds these addresses as IPs; an address resolved once at load time goes stale
    when the name moves (a rescheduled pod), and every request to it would then fail."""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("address must be ip:port with a port in 1..65535 (IPv6 as [ip]:port)")
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        raise ValueError(
            f"address host {host!r} is not an IP address: Envoy routes to the picker's pick as ip:port "
            "(override_host), so a DNS name would fail every request with 503; list the replica's IP "
            "(names are not resolved, because an address resolved once goes stale when the name moves)"
        ) from None
    if ip.version == 6 and literal == host:
        raise ValueError("an IPv6 address must be in brackets: [ip]:port")
    # canonical form: Envoy reports the endpoint that served as [::1]:8000, never [0:0:0:0:0:0:0:1]:8000
    return f"[{ip.compressed}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def _metrics_path(v: str) -> str:
    if not v.startswith("/") or len(v) > 256 or not v.isascii() or any(c.isspace() or ord(c) < 0x21 for c in v):
        raise ValueError("must be an absolute URL path (starts with /, ASCII, no spaces, at most 256 characters)")
    return v


class HealthProbeConfig(_Section):
    """Active health (``picker.pool.health_probe``): catches a replica that accepts connections and never
    answers, which no status ever reports when clients give up first.

    A *suspicion* (never a failure on its own) triggers one GET of ``http://<address><path>`` bounded by
    ``timeout_ms``: a client that gave up before the response's first byte (while that probe runs, the
    endpoint is routed to only when no other one is eligible), or two engine-metrics scrapes in a row that got
    no answer (timed out, refused, reset). No answer within the timeout, a refused or reset connection, or
    a 5xx ejects the endpoint (reason ``probe_failed``); any other status is an answer (a replica without a
    health route answers 404 and stays). An endpoint ejected so is probed every ``interval_ms`` and readmitted
    after ``readmit_after`` answers in a row (reason ``probe_ok``), not after a cooldown: a replica that still
    hangs is never readmitted to hang more clients. At most one probe per endpoint is in flight."""

    enabled: bool = True
    path: Annotated[str, AfterValidator(_metrics_path)] = "/health"
    # real vLLM on a loaded 2-core machine answered /health later than 1 s (docs/real-engines.md)
    timeout_ms: int = Field(3000, ge=50, le=60_000)
    interval_ms: int = Field(1000, ge=50, le=600_000)  # while ejected by a probe: how often it is probed again
    readmit_after: int = Field(2, ge=1, le=100)  # answers in a row that readmit it


class HealthConfig(_Section):
    """Windowed success rate from response status; below the floor an endpoint is excluded."""

    window_size: int = Field(50, ge=1, le=10_000)  # last N responses per endpoint
    min_samples: int = Field(5, ge=1, le=10_000)
    unhealthy_below: float = Field(0.5, ge=0.0, le=1.0)
    cooldown_seconds: float = Field(10.0, ge=0.0, le=3600.0)  # then readmitted on probation
    # Also ejected after this many failures in a row, whatever the window holds (0: off): bounds how
    # long a replica that just went dead or hung keeps getting traffic after a long healthy history.
    consecutive_failures: int = Field(5, ge=0, le=10_000)
    probe: HealthProbeConfig = HealthProbeConfig()


class EngineMetricsConfig(_Section):
    """Engine signals: every ``interval_ms`` each pool endpoint's ``http://<address><path>`` (Prometheus text)
    is scraped off the request path; its queue (waiting, running) and KV-cache usage reach the pool snapshot
    (``EndpointState.engine``), so other pickers' and other clients' load is seen. vLLM and SGLang names.

    On by default: vLLM serves ``/metrics`` on its serving port (SGLang with ``--enable-metrics``), which is
    where the pool's addresses point, and the cost scorer needs the engines' own queues to see load that did
    not pass through this picker. It costs one small GET per endpoint per interval. An endpoint without it
    (a plain HTTP upstream, like the echo backends of this repo's tests) answers 404: the scrape is counted
    as an error, logged once when it starts failing, and its signals stay unknown (``engine=None``), exactly
    as with ``enabled: false``.

    A failed scrape keeps the last good values until they are ``stale_after_ms`` old; then they are withdrawn.
    ``stale_after_ms`` must exceed ``interval_ms + timeout_ms`` (the age a healthy endpoint's last scrape
    reaches before the next one lands), and ``timeout_ms`` may not exceed ``interval_ms``."""

    enabled: bool = True
    path: Annotated[str, AfterValidator(_metrics_path)] = "/metrics"
    interval_ms: int = Field(1000, ge=20, le=600_000)
    timeout_ms: int = Field(500, ge=10, le=60_000)  # one scrape: connect, answer and body
    stale_after_ms: int = Field(3000, ge=50, le=3_600_000)
    max_bytes: int = Field(4 << 20, ge=4096, le=64 << 20)  # a larger body is refused (too_large), not parsed
    max_concurrency: int = Field(16, ge=1, le=1024)  # scrapes in flight at once

    @model_validator(mode="after")
    def _timing(self) -> EngineMetricsConfig:
        if self.timeout_ms > self.interval_ms:
            raise ValueError("timeout_ms may not exceed interval_ms (a round must end before the next is due)")
        if self.stale_after_ms <= self.interval_ms + self.timeout_ms:
            raise ValueError(
                "stale_after_ms must exceed interval_ms + timeout_ms (a healthy endpoint's last scrape reaches "
                "that age before the next one lands)"
            )
        return self


class EngineModelsConfig(_Section):
    """What each engine serves: every ``interval_ms`` each pool endpoint's ``http://<address><path>`` (the OpenAI
    models list: vLLM lists its base model and every LoRA adapter registered with it, ``parent`` = its base
    model) is read off the request path (``picker.pool.engine_models``). Where the engines list a request's model,
    they decide its base model and adapter for Tier 4's keys instead of ``kv_cache_index.lora_adapters``, and an
    endpoint that does not list an adapter scores 0 for LoRA affinity (docs/llm-d-compat.md, "LoRA").

    Slower than the engine signals on purpose: adapters are registered rarely (at start, or through vLLM's
    ``/v1/load_lora_adapter``). A failed read keeps the endpoint's last list (an engine restart that changed
    it is seen at the next good read); an endpoint that leaves the pool loses its list. An endpoint without the
    route (404) has no list and the static map applies to it."""

    enabled: bool = True
    path: Annotated[str, AfterValidator(_metrics_path)] = "/v1/models"
    interval_ms: int = Field(10_000, ge=100, le=3_600_000)
    timeout_ms: int = Field(2000, ge=10, le=60_000)  # one read: connect, answer and body
    max_bytes: int = Field(1 << 20, ge=4096, le=64 << 20)  # a larger body is refused, not parsed
    max_models: int = Field(256, ge=1, le=100_000)  # entries kept per endpoint (base models and adapters); more: cut
    max_concurrency: int = Field(16, ge=1, le=1024)  # reads in flight at once

    @model_validator(mode="after")
    def _timing(self) -> EngineModelsConfig:
        if self.timeout_ms > self.interval_ms:
            raise ValueError("timeout_ms may not exceed interval_ms (a round must end before the next is due)")
        return self


class PoolConfig(_Section):
    """The pool: a static list (``backends``), or discovered: an InferencePool (``inference_pool``, also
    ``KV_EPP_POOL__INFERENCE_POOL__NAME`` / ``__NAMESPACE``) or a YAML file of backends (``backends_file``).
    At most one of the three. A discovered pool's backends are named after their pods, weight 1; the source
    is restart-required, the other keys hot-reloadable (a reloaded config cannot list ``backends`` beside
    a discovery source: it is refused like any other bad file)."""

    # engine replicas, and external backends of ``type: gemini`` (allowed beside a discovery source)
    backends: tuple[AnyBackend, ...] = ()
    inference_pool: InferencePoolRef | None = None
    backends_file: BackendsFileRef | None = None
    health: HealthConfig = HealthConfig()
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    engine_models: EngineModelsConfig = EngineModelsConfig()
    latency_ewma_alpha: float = Field(0.2, gt=0.0, le=1.0)
    # Ranked fallbacks sent after the pick (comma-separated destination list): where Envoy retries when
    # the pick refuses, resets or times out. Keep the Envoy retry count (`kv-epp envoy-config --retries`)
    # equal to it.
    fallbacks: int = Field(2, ge=0, le=8)

    @model_validator(mode="after")
    def _unique(self) -> PoolConfig:
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate backend names: {sorted(dup)}")
        models = [m for g in self.gemini for m in g.models]
        dup = {m for m in models if models.count(m) > 1}
        if dup:
            raise ValueError(f"a model is listed by two gemini backends: {sorted(dup)}")
        addrs = [b.address for b in self.engines]
        dup = {a for a in addrs if addrs.count(a) > 1}
        if dup:
            raise ValueError(f"duplicate backend addresses: {sorted(dup)}")
        return self

    @property
    def engines(self) -> tuple[BackendConfig, ...]:
        """The static engine replicas (``backends`` less the gemini ones)."""
        return tuple(b for b in self.backends if isinstance(b, BackendConfig))

    @property
    def gemini(self) -> tuple[GeminiBackendConfig, ...]:
        """The backends of ``type: gemini``."""
        return tuple(b for b in self.backends if isinstance(b, GeminiBackendConfig))

    @property
    def source(self) -> str:
        """Where the pool comes from: ``static``, ``inference_pool`` or ``backends_file``."""
        if self.inference_pool is not None:
            return "inference_pool"
        if self.backends_file is not None:
            return "backends_file"
        return "static"

    @property
    def discovered(self) -> bool:
        return self.inference_pool is not None or self.backends_file is not None


# llm-d's agent identity headers: a session's id when ``session_affinity.header`` is absent (the session table,
# ConsistentHash), and flow control's fairness id when its own header is absent (docs/llm-d-compat.md)
AGENT_IDENTITY_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")
SESSION_TOKEN_HEADER = "x-session-token"  # llm-d's stateless affinity token


MetricsCompat = Literal["llm-d", "continuum", "both"]


class MetricsConfig(_Section):
    """Which metric names the picker's ``/metrics`` exports (docs/llm-d-compat.md, "Metrics"). ``both``
    (default): ours and llm-d's. ``llm-d``: llm-d's ``llm_d_epp_*`` families with their deprecated aliases
    (``inference_objective_*``, ``inference_pool_*``, ``inference_extension_*``) and our ``kv_epp_*`` families; the
    ``continuum_*`` families are not exported (the chart's own dashboards and alert rules read them). ``continuum``:
    only our families, llm-d's request, pool, scheduler and in-flight families are neither recorded nor exported
    (flow control's ``llm_d_epp_flow_control_*`` stay: they are its only names). Hot-reloadable.

    ``pool_name``: the ``name`` label of the pool families; None: the InferencePool's name
    (``pool.inference_pool.name``), else ``kv-epp``."""

    compat: MetricsCompat = "both"
    pool_name: str | None = Field(None, min_length=1, max_length=253)


class SessionAffinityConfig(_Section):
    """Sticky sessions by header; bounded map, LRU + TTL. ``identity_headers``: further headers that name a
    session when ``header`` is absent (llm-d's agent identity headers; also flow control's fairness id).
    ``token``: llm-d's stateless affinity (``x-session-token``, the base64 of ``namespace/name`` of the endpoint
    that served the conversation, echoed on every routed response and honoured while that endpoint is eligible;
    no table), independent of ``enabled``. See docs/llm-d-compat.md."""

    enabled: bool = False
    header: Annotated[str, AfterValidator(_header_name)] = "x-session-id"
    identity_headers: tuple[Annotated[str, AfterValidator(_header_name)], ...] = Field(
        AGENT_IDENTITY_HEADERS, max_length=16
    )
    token: bool = True
    ttl_seconds: float = Field(1800.0, gt=0.0)
    max_sessions: int = Field(100_000, ge=1, le=10_000_000)


class DisaggregationConfig(_Section):
    """Prefill/decode disaggregation (docs/pd.md). The decode endpoint is picked first (roles ``decode`` and
    ``both``); when the prompt's uncached tokens on it are at least ``min_uncached_tokens`` (and the prompt at
    least ``min_prompt_tokens``), a prefill endpoint (roles ``prefill`` and ``both``, scored by the cost model on
    what it holds and its queue) is named in ``x-prefiller-host-port`` for the decode pod's routing sidecar.
    ``decide: cost`` also asks the cost model: the predicted TTFT of a remote prefill plus the KV transfer must be
    at most ``max_ttft_ratio`` x the local prefill's plus the stall a local prefill imposes on the streams decoding
    there (``decode_stall_weight``); ``threshold`` is llm-d's rule alone."""

    enabled: bool = False
    min_uncached_tokens: int = Field(512, ge=0, le=10_000_000)
    min_prompt_tokens: int = Field(0, ge=0, le=10_000_000)
    # no prefill endpoint eligible: refuse (503, reason no_prefill_endpoint) or decode locally (counted, logged)
    fallback: Literal["reject", "decode_only"] = "reject"
    decide: Literal["cost", "threshold"] = "cost"
    # a remote prefill may be predicted this much slower than the local one and still be chosen: what it buys is
    # the decode streams' inter-token latency on the decode endpoint, which a local prefill stalls
    max_ttft_ratio: float = Field(1.2, ge=0.0, le=100.0)
    # a local prefill also stalls the streams decoding on the decode endpoint, each by about its duration: that
    # stall, times this weight, counts against keeping the prefill local (1: a stream's wait counts as much as this
    # request's; 0: this request's TTFT alone decides)
    decode_stall_weight: float = Field(1.0, ge=0.0, le=1000.0)
    # the KV transfer's prior cost per token (calibrated online from P/D requests' first tokens, ``/admin/pool``)
    transfer_ms_per_token: float = Field(0.02, ge=0.0, le=100.0)


class SharedLoadConfig(_Section):
    """The load view pickers share (docs/scale-out.md): each picker publishes its own in-flight requests, pending
    prefill tokens and decoding requests per endpoint, and its recent placements, to one Valkey/Redis stream (on
    ``response_cache.redis``'s server), reads its peers' from it, and scores every endpoint on the sum. A peer silent
    for ``peer_ttl_ms`` is dropped; while the stream is out of reach the picker scores on its own counts and the
    engines' metrics, says so in ``/readyz`` and ``continuum_picker_shared_load_up``, and keeps routing."""

    enabled: bool = False
    # the stream; keep the {...} hash tag: on a cluster the key lives on one slot (any name: pools sharing a
    # Valkey use one key each)
    key: str = Field("kv-epp:{load}", min_length=1, max_length=200)
    picker_id: str | None = Field(None, min_length=1, max_length=128)  # None: <hostname>-<pid>-<random>
    publish_min_interval_ms: int = Field(10, ge=1, le=10_000)  # changes are published at most this often
    heartbeat_ms: int = Field(250, ge=10, le=60_000)  # published at least this often, changes or not
    peer_ttl_ms: int = Field(2000, ge=50, le=600_000)  # a peer silent this long is dropped (a dead picker ages out)
    max_stream_len: int = Field(10_000, ge=100, le=10_000_000)  # entries the stream keeps (XADD MAXLEN ~)
    max_peers: int = Field(256, ge=1, le=10_000)  # peers followed; a newer one beyond it is ignored (counted)
    share_placements: bool = True  # publish and apply recent placements (kv_cache_index.recent_placements_seconds)
    max_placement_keys: int = Field(65_536, ge=0, le=10_000_000)  # block keys per published message (rest dropped)
    retry_seconds: float = Field(1.0, gt=0.0, le=300.0)  # while the stream is out of reach: the reconnect period

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if any(c.isspace() for c in v) or CONTROL_CHARS.search(v):
            raise ValueError("no spaces or control characters")
        return v

    @model_validator(mode="after")
    def _ttl_over_heartbeat(self) -> SharedLoadConfig:
        if self.peer_ttl_ms < 2 * self.heartbeat_ms:
            raise ValueError(
                f"peer_ttl_ms ({self.peer_ttl_ms}) must be at least twice heartbeat_ms ({self.heartbeat_ms}): a live "
                "peer would age out between two of its heartbeats"
            )
        return self


class ExtProcTlsConfig(_Section):
    """TLS on the ext_proc port: on by default (gateways and reference EPPs speak TLS to the picker).

    ``cert_file`` + ``key_file`` (PEM): re-read on rotation (checked at each new connection), no restart.
    Neither: a self-signed certificate is generated at start, in memory only. The separate
    ``extproc.health_port`` stays plaintext (kubelet gRPC probes do not speak TLS)."""

    mode: Literal["tls", "plaintext"] = "tls"  # plaintext only when asked for
    cert_file: str | None = None  # certificate chain, PEM
    key_file: str | None = None  # its private key, PEM (unencrypted)
    client_ca_file: str | None = None  # PEM bundle: when set, clients must present a certificate it signs

    @model_validator(mode="after")
    def _consistent(self) -> ExtProcTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (neither: a self-signed certificate is generated)")
        if self.mode == "plaintext" and (self.cert_file or self.client_ca_file):
            raise ValueError("mode plaintext takes no cert_file, key_file or client_ca_file")
        return self


class ExtProcAuthConfig(_Section):
    """A shared token Envoy sends in gRPC initial metadata (``authorization: Bearer <token>``).

    Client authentication is a token (``token_file``) or client certificates (``extproc.tls.client_ca_file``).
    Bound beyond loopback (``extproc.host``) without either, the picker refuses to start: anyone who reaches the
    port could open streams, hold in-flight leases and steer routing. ``allow_unauthenticated: true`` starts it
    anyway (warned at start and in ``/readyz``), for a gateway that cannot authenticate, behind a NetworkPolicy."""

    token_file: str | None = None  # file holding the token (read at start); None: no token required
    allow_unauthenticated: bool = False  # beyond loopback without a token or client certificates: start anyway


class ExtProcConfig(_Section):
    # Loopback by default (a sidecar picker: Envoy in the same pod or host). Beyond loopback (0.0.0.0, ::, a pod
    # IP, a name that resolves to one) the port needs client authentication (``auth``), or the picker refuses to
    # start. The gRPC health port (``health_port``) binds the same host.
    host: str = "127.0.0.1"
    port: int = Field(9002, ge=0, le=65535)
    health_port: int | None = Field(9003, ge=0, le=65535)  # None: health only on the ext_proc port
    max_body_bytes: int = Field(8 << 20, ge=1024, le=256 << 20)
    drain_seconds: float = Field(10.0, ge=0.0, le=600.0)
    # SIGTERM: readiness is NOT_SERVING this long before new streams are refused, so load balancers and
    # health checks stop sending first (raise it to the probe period in Kubernetes).
    drain_propagation_seconds: float = Field(1.0, ge=0.0, le=60.0)
    # When ``kv-epp.accepting`` (what Envoy health-checks) turns NOT_SERVING in a drain. "drain": at its start,
    # so an Envoy with several pickers sends new streams to the others during the propagation. "refusing":
    # only when new streams are refused, for a picker that is its Envoy's only one (a sidecar): an Envoy
    # whose sole picker is unhealthy fails closed (500) while the picker would still have served.
    accepting_until: Literal["drain", "refusing"] = "drain"
    tenant_header: Annotated[str, AfterValidator(_header_name)] = "x-tenant-id"
    # Used only when Envoy does not announce its processing mode (protocol_config) on the stream.
    default_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = "FULL_DUPLEX_STREAMED"
    # Response sampling (Envoy config ``--response-mode sampled``, BUFFERED body mode): this fraction of
    # routed requests, and every request carrying the opt-in header, stream their response body through the
    # picker so the delivered cached_tokens are measured on the sample; the others cost no body message.
    response_sample_rate: float = Field(0.1, ge=0.0, le=1.0)
    response_sample_header: Annotated[str, AfterValidator(_header_name)] = "x-kv-epp-sample"
    # The process's event loop: uvloop when installed (auto), or forced either way (restart required).
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # Open ext_proc streams per peer IP address (0: no cap); a stream over it is refused with RESOURCE_EXHAUSTED
    # before it reaches admission or the pool (it holds no lease), counted in
    # continuum_picker_extproc_refused_streams_total{reason="peer_limit"}. Per IP, not per identity: the token is
    # shared by every Envoy and identifies none, while one Envoy is one IP (it multiplexes all its requests, one
    # stream each, over a few HTTP/2 connections). Admission (admission.max_open_streams, 1,024) admits at most
    # that many streams from all peers and answers the rest 429 at their first message, so 4x that never
    # refuses a legitimate Envoy before admission does: it bounds what one peer keeps open beyond admission
    # (streams that never send a message). Below admission.max_open_streams it also keeps one peer from taking
    # the whole admission budget when several Envoys share the picker (a sidecar's lone Envoy is then capped
    # too). Behind a proxy that terminates connections every client is one peer.
    max_streams_per_peer: int = Field(4096, ge=0, le=1_000_000)
    # llm-d's --emit-endpoint-scores: each candidate's score in the pick's ``envoy.lb`` dynamic metadata, under
    # ``x-gateway-destination-endpoint-scores`` (docs/llm-d-compat.md)
    emit_endpoint_scores: bool = False
    tls: ExtProcTlsConfig = ExtProcTlsConfig()
    auth: ExtProcAuthConfig = ExtProcAuthConfig()

    @property
    def client_authentication(self) -> tuple[str, ...]:
        """How ext_proc clients authenticate: ``token`` and/or ``client_cert``; empty: anonymous."""
        out = ("token",) if self.auth.token_file is not None else ()
        return out + (("client_cert",) if self.tls.client_ca_file is not None else ())


LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


def loopback_host(host: str) -> bool | None:
    """Whether binding ``host`` listens on loopback only, without a DNS lookup: an IP literal (``[::1]`` too) or
    ``localhost`` decides; ``0.0.0.0``, ``::`` and ``""`` (every interface) are not loopback; None for another
    name (resolved at start: ``picker.runtime.tls.bind_is_loopback``)."""
    literal = host.strip()
    if literal.startswith("[") and literal.endswith("]"):
        literal = literal[1:-1]
    if not literal:
        return False  # gRPC and asyncio bind every interface for an empty host
    if literal.lower() in LOOPBACK_NAMES or literal.lower().endswith(".localhost"):
        return True  # RFC 6761: localhost names resolve to loopback only
    try:
        ip = ipaddress.ip_address(literal.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def unauthenticated_exposure(x: ExtProcConfig, loopback: bool | None) -> tuple[str, str] | None:
    """The refusal (path, message) when ext_proc would listen beyond loopback with no client authentication
    and ``auth.allow_unauthenticated`` is not set; None otherwise (or when ``loopback`` is unknown)."""
    if loopback is not False or x.client_authentication or x.auth.allow_unauthenticated:
        return None
    return (
        "extproc.host",
        f"{x.host!r} is beyond loopback and the ext_proc port has no client authentication: anyone who reaches it "
        "can open streams, hold in-flight leases and steer routing. Set extproc.auth.token_file (the token Envoy "
        "sends: kv-epp envoy-config --picker-token-file) or extproc.tls.client_ca_file (client certificates), bind "
        "extproc.host to 127.0.0.1 (a sidecar), or set extproc.auth.allow_unauthenticated: true",
    )


class AdmissionConfig(_Section):
    """Admission control over all streams (hot-reloadable): past any bound a request is answered 429 with
    ``Retry-After`` and a JSON error, never queued. Defaults sized for a 2-core picker (docs/operations.md, Bounds)."""

    # Request bodies buffered by all streams together (each stream is also bound by extproc.max_body_bytes);
    # a stream's declared Content-Length is reserved at its headers, chunks beyond it as they come.
    max_buffered_body_bytes: int = Field(64 << 20, ge=1024, le=4 << 30)
    max_open_streams: int = Field(1024, ge=1, le=1_000_000)  # ext_proc streams (= requests) open at once
    # Saturation: every eligible endpoint has at least this many requests in flight (0: no bound).
    max_in_flight_per_endpoint: int = Field(512, ge=0, le=1_000_000)
    max_in_flight_total: int = Field(0, ge=0, le=10_000_000)  # across the pool (0: no bound)
    retry_after_seconds: int = Field(1, ge=1, le=3600)  # the Retry-After header of a 429


FairnessPolicy = Literal["global_fifo", "round_robin", "token_weighted"]
OrderingPolicy = Literal["fcfs", "edf"]


class FlowObjectiveConfig(_Section):
    """One InferenceObjective (named by the request header ``x-llm-d-inference-objective``)."""

    priority: int = Field(0, ge=-1_000_000, le=1_000_000)  # higher first; negative: sheddable


class FlowBandConfig(_Section):
    """Bounds of one priority band (every field unset: the section-wide value)."""

    max_requests: int | None = Field(None, ge=1, le=10_000_000)
    max_bytes: int | None = Field(None, ge=1024, le=64 << 30)
    ttl_ms: int | None = Field(None, ge=1, le=86_400_000)
    # dispatch only while the pool's saturation is below this: a band below 1.0 leaves headroom that only
    # higher bands may use (their requests then start on an engine that still has room); above 1.0 (at most
    # 4.0) the band dispatches past saturation, for a top band that must not wait behind the
    # engines' queues. Missing or old engine readings stop every band (fail closed).
    saturation_limit: float | None = Field(None, gt=0.0, le=4.0)


class FlowSaturationConfig(_Section):
    """When the pool is saturated (dispatch halts). Per endpoint, the largest of: the engine's waiting requests
    / ``queue_depth_threshold``, its KV usage / ``kv_cache_threshold``, this picker's pending prefill tokens /
    ``pending_prefill_tokens_threshold`` and its requests in flight / ``in_flight_threshold`` (a threshold of 0
    leaves its signal out); the pool's saturation is the mean over its routable endpoints. An endpoint whose
    engine signals are missing or older than ``max_signal_age_ms`` counts as saturated (fail closed) while
    ``pool.engine_metrics`` is on."""

    queue_depth_threshold: int = Field(5, ge=0, le=1_000_000)
    kv_cache_threshold: float = Field(0.8, ge=0.0, le=1.0)
    pending_prefill_tokens_threshold: int = Field(0, ge=0, le=100_000_000)
    in_flight_threshold: int = Field(0, ge=0, le=1_000_000)
    max_signal_age_ms: int = Field(3000, ge=50, le=3_600_000)


class FlowControlConfig(_Section):
    """Flow control (hot-reloadable; off by default): a request waits in a bounded queue while the pool is
    saturated, instead of the 429 of admission's in-flight bounds. Its flow is its fairness id
    (``x-llm-d-inference-fairness-id``, default ``default-flow``) and its priority (the InferenceObjective named
    by ``x-llm-d-inference-objective``: ``objectives`` here, else watched InferenceObjective objects; unknown or
    unnamed: 0). Bands drain in strict priority order; inside a band ``fairness`` picks the flow, ``ordering``
    the request. A request leaves the queue dispatched, or dropped with ``x-llm-d-request-dropped-reason``.
    See docs/flow-control.md."""

    enabled: bool = False
    fairness: FairnessPolicy = "global_fifo"
    ordering: OrderingPolicy = "fcfs"
    objectives: dict[str, FlowObjectiveConfig] = Field(default_factory=dict, max_length=10_000)
    # with pool.inference_pool: watch InferenceObjective objects whose poolRef is ours (restart-required)
    watch_objectives: bool = True
    max_requests: int = Field(5000, ge=1, le=10_000_000)  # queued, all bands together
    max_bytes: int = Field(1 << 30, ge=1024, le=64 << 30)  # queued request bytes, all bands together
    default_band: FlowBandConfig = FlowBandConfig()
    bands: dict[int, FlowBandConfig] = Field(default_factory=dict, max_length=1000)  # by priority
    default_ttl_ms: int = Field(60_000, ge=1, le=86_400_000)
    no_endpoints_ttl_ms: int = Field(10_000, ge=1, le=86_400_000)  # while the pool has no routable endpoint
    expected_output_tokens: int = Field(256, ge=0, le=10_000_000)  # token_weighted: a request without max_tokens
    max_flows: int = Field(10_000, ge=1, le=1_000_000)  # flows with queued requests; a new one past it is refused
    saturation: FlowSaturationConfig = FlowSaturationConfig()


class RewriteModelMatchConfig(_Section):
    """The request's ``model`` a rule matches: exactly (the only match type of the CRD)."""

    type: Literal["Exact"] = "Exact"
    value: str = Field(min_length=1, max_length=MODEL_NAME_MAX)


class RewriteMatchConfig(_Section):
    """One match of a rule (the CRD's ``matches[]``)."""

    model: RewriteModelMatchConfig


class RewriteTargetConfig(_Section):
    """One weighted target of a rule: the model the request is rewritten to (the CRD's ``targets[]``). Weights are
    set on every target of a rule or on none (an even split); a target's share is its weight / their sum."""

    # the CRD's spelling in the file and in a dump (a dumped config parses again)
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)

    model_rewrite: str = Field(alias="modelRewrite", min_length=1, max_length=MODEL_NAME_MAX)
    weight: int | None = Field(None, ge=1, le=MAX_REWRITE_WEIGHT)


class RewriteRuleConfig(_Section):
    """A rule: a request whose ``model`` equals one of ``matches`` is rewritten to one of ``targets``, drawn by
    weight; no ``matches``: a generic rule, for every model no exact rule matches."""

    matches: tuple[RewriteMatchConfig, ...] = Field((), max_length=MAX_RULE_ITEMS)
    targets: tuple[RewriteTargetConfig, ...] = Field(max_length=MAX_RULE_ITEMS)

    @field_validator("targets")
    @classmethod
    def _weights_all_or_none(cls, v: tuple[RewriteTargetConfig, ...]) -> tuple[RewriteTargetConfig, ...]:
        # here, not min_length: pydantic counts a tuple's length after dropping its invalid items
        if not v:
            raise ValueError("a rule needs at least one target")
        weighted = [t.weight is not None for t in v]
        if any(weighted) and not all(weighted):
            first = weighted.index(False)
            raise ValueError(
                f"targets[{first}] has no weight while another target has one: set a weight on every target or on "
                "none (an even split)"
            )
        return v


class ModelRewriteConfig(_Section):
    """An InferenceModelRewrite given in the config (its ``metadata.name`` and ``spec.rules``, in the CRD's own
    spelling, so a rule can be copied from an object). Config rewrites rank before every watched object (as if
    older); docs/llm-d-compat.md, "InferenceModelRewrite"."""

    name: str = Field(min_length=1, max_length=253)
    rules: tuple[RewriteRuleConfig, ...] = Field(max_length=MAX_REWRITE_RULES)

    @field_validator("rules")
    @classmethod
    def _some_rules(cls, v: tuple[RewriteRuleConfig, ...]) -> tuple[RewriteRuleConfig, ...]:
        if not v:
            raise ValueError("a rewrite needs at least one rule")
        return v


def _gemini_ttl(v: str) -> str:
    if duration_seconds(v) < 60.0:
        raise ValueError("ttl must be at least 60s")
    return v


class GeminiContextCacheConfig(_Section):
    """The seed's Gemini context cache (restart-required; off by default: then nothing is allocated and no task
    runs). For requests to a ``type: gemini`` backend whose system prompt is at least ``min_prefix_bytes``, the
    picker keeps a server-side ``cachedContents`` resource per (model, whole system prompt) and references it in
    later requests. See docs/gemini.md."""

    enabled: bool = False
    min_prefix_bytes: int = Field(16384, ge=1024, le=64 << 20)  # approximates Google's minimum cacheable tokens
    ttl: Annotated[str, AfterValidator(_gemini_ttl)] = "10m"  # of a created resource
    extend_on_hit: bool = False  # a hit within the last 20% of the TTL extends it (PATCH), in the background
    max_entries: int = Field(1000, ge=10, le=1_000_000)  # tracked resources and refused prefixes together; LRU
    create_timeout_ms: int = Field(5000, ge=500, le=60_000)
    negative_ttl_seconds: int = Field(600, ge=1, le=86_400 * 30)  # a refused prefix is not retried this long
    # chat completions to a gemini backend use the native generateContent / streamGenerateContent instead of
    # the OpenAI-compatible /v1beta/openai/chat/completions
    prefer_native_api: bool = False

    @property
    def ttl_seconds(self) -> float:
        return duration_seconds(self.ttl)


ARM_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
MAX_ARMS = 8  # bounds every per-arm series and table
# the keys an arm may overlay, and below them the keys that apply per request (the rest of their sections are
# built once per process: a Tier 4 the picker did not start cannot be turned on for one arm)
ARM_OVERLAY_KEYS: dict[str, frozenset[str] | None] = {
    "selection_strategy": None,
    "prefix_routing": None,  # any of its keys
    "kv_cache_index": frozenset({"enabled", "scoring"}),
    "session_affinity": frozenset({"enabled"}),
    "pool": frozenset({"fallbacks"}),
}
# the headers that name a session for the assignment, after ``session_affinity.header``: the agent identity
# headers (docs/experiments.md). Not llm-d's x-session-token: it names an endpoint, not a conversation (every
# conversation on one endpoint carries the same token, and an arm's own pick would choose the arm)
DEFAULT_SESSION_HEADERS = AGENT_IDENTITY_HEADERS


def _arm_name(v: str) -> str:
    if not ARM_NAME_RE.fullmatch(v):
        raise ValueError("an arm name is 1-32 of a-z, 0-9, '_' and '-', starting with a letter or digit")
    return v


class ExperimentArmConfig(BaseModel):
    """One arm: its ``weight`` (its share of the sessions is weight / the sum of weights) and the config keys its
    requests route with instead of the picker's (``ARM_OVERLAY_KEYS``; validated against the picker's config by
    ``arm_settings``)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    weight: float = Field(1.0, gt=0.0, le=1_000_000.0)
    # the pool's endpoints this arm routes to (a pool of its own: arms that share no engine share no queue and
    # no cache); empty: every endpoint of the pool
    endpoints: tuple[BackendName, ...] = Field((), max_length=10_000)

    @property
    def overlay(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentsConfig(_Section):
    """Session-level experiments (hot-reloadable; off by default): each session is assigned to an arm by a stable
    hash of its key and ``salt``, and its requests route with that arm's config. ``decision_log``: ``stdout`` or
    a file (rotated at ``decision_log_max_bytes``, ``decision_log_backups`` kept), one JSON line per request, no
    prompt text; None writes none. See docs/experiments.md."""

    enabled: bool = False
    salt: str = Field("kv-epp", min_length=1, max_length=128)  # a new salt re-draws every session's arm
    arms: dict[Annotated[str, AfterValidator(_arm_name)], ExperimentArmConfig] = Field(
        default_factory=dict, max_length=MAX_ARMS
    )
    session_headers: tuple[Annotated[str, AfterValidator(_header_name)], ...] = Field(
        DEFAULT_SESSION_HEADERS, max_length=16
    )
    decision_log: str | None = Field(None, min_length=1, max_length=4096)
    decision_log_max_bytes: int = Field(64 << 20, ge=4096, le=1 << 40)
    decision_log_backups: int = Field(3, ge=0, le=100)
    decision_log_queue: int = Field(10_000, ge=1, le=1_000_000)  # records waiting for the writer; more: dropped
    max_sessions: int = Field(100_000, ge=1, le=10_000_000)  # the turn and gap table, LRU
    preemption_window_seconds: float = Field(30.0, ge=1.0, le=3600.0)

    @model_validator(mode="after")
    def _arms_when_enabled(self) -> ExperimentsConfig:
        if self.enabled and not self.arms:
            raise ValueError("experiments.enabled needs at least one arm in experiments.arms")
        return self


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arm_settings(base: Settings, name: str, arm: ExperimentArmConfig) -> Settings:
    """The picker's config with ``arm``'s overlay applied; ConfigError naming ``experiments.arms.<name>.<key>``
    for a key an arm cannot overlay or a value its section refuses."""
    at = f"experiments.arms.{name}"
    problems: list[tuple[str, str]] = []
    update: dict[str, Any] = {}
    for key, value in arm.overlay.items():
        if key not in ARM_OVERLAY_KEYS:
            allowed = ", ".join(["weight", "endpoints", *ARM_OVERLAY_KEYS])
            problems.append((f"{at}.{key}", f"an arm cannot overlay this key per request (an arm takes {allowed})"))
            continue
        subkeys = ARM_OVERLAY_KEYS[key]
        if key == "selection_strategy":
            if value not in STRATEGIES:
                problems.append((f"{at}.{key}", f"must be one of {', '.join(STRATEGIES)}"))
            else:
                update[key] = value
            continue
        if not isinstance(value, dict):
            problems.append((f"{at}.{key}", "must be a mapping of that section's keys"))
            continue
        bad = [k for k in value if subkeys is not None and k not in subkeys]
        for k in bad:
            problems.append((f"{at}.{key}.{k}", f"not per request: an arm may set {', '.join(sorted(subkeys or ()))}"))
        if bad:
            continue
        section = getattr(base, key)
        try:
            update[key] = type(section).model_validate(_merged(section.model_dump(), value))
        except ValidationError as exc:
            problems.extend((f"{at}.{key}.{p}", m) for p, m in validation_problems(exc))
    if arm.endpoints and not base.pool.discovered:
        known = {b.name for b in base.pool.engines}
        for i, e in enumerate(arm.endpoints):
            if e not in known:
                problems.append((f"{at}.endpoints[{i}]", f"{e!r} is not a backend of pool.backends"))
    kv = update.get("kv_cache_index")
    if kv is not None and kv.enabled and not base.kv_cache_index.enabled:
        problems.append(
            (f"{at}.kv_cache_index.enabled", "Tier 4 is off in the picker's config: an arm can turn it off, not on")
        )
    if problems:
        raise ConfigError(problems)
    return base.model_copy(update=update)


ADMIN_TOKEN_FILE_MAX_BYTES = 4096  # a bearer token is short: a larger file is refused, never read whole


class AdminConfig(_Section):
    """The admin HTTP server. ``/admin/*`` needs ``Authorization: Bearer <token>`` when a token is set, either
    inline (``bearer_token``, also ``KV_EPP_ADMIN__BEARER_TOKEN``) or as a file (``bearer_token_file``: its
    content with surrounding whitespace removed, e.g. a mounted Kubernetes Secret), never both. The file is
    read when the admin server starts (unreadable or empty: the picker does not start) and again after every
    applied config reload (``read_bearer_token``)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9090, ge=0, le=65535)
    bearer_token: str | None = None  # required for /admin/* when set
    bearer_token_file: str | None = Field(None, min_length=1)  # a file holding the token instead

    @field_validator("bearer_token_file")
    @classmethod
    def _one_token_source(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("bearer_token") is not None:
            raise ValueError(
                "admin.bearer_token is set too (in the file or as KV_EPP_ADMIN__BEARER_TOKEN): set one of "
                "admin.bearer_token, admin.bearer_token_file"
            )
        return v

    @property
    def has_token(self) -> bool:
        """A token guards /admin/* (inline, or the file's)."""
        return bool(self.bearer_token) or self.bearer_token_file is not None

    def read_bearer_token(self) -> str | None:
        """The token /admin/* requires (None: none); ``bearer_token_file`` is read now. Raises ConfigError
        naming ``admin.bearer_token_file`` when the file cannot be read, is empty, too large, not UTF-8, or
        holds a control character inside the token (several lines)."""
        path = self.bearer_token_file
        if path is None:
            return self.bearer_token or None
        key = "admin.bearer_token_file"
        try:
            with open(path, "rb") as f:
                raw = f.read(ADMIN_TOKEN_FILE_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError([(key, f"{path}: cannot read it ({exc.strerror or exc})")]) from None
        if len(raw) > ADMIN_TOKEN_FILE_MAX_BYTES:
            raise ConfigError([(key, f"{path}: larger than {ADMIN_TOKEN_FILE_MAX_BYTES} bytes, not a token")])
        try:
            token = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError([(key, f"{path}: not UTF-8 text")]) from None
        if not token:
            raise ConfigError([(key, f"{path}: empty (the token is the file's content)")])
        if CONTROL_CHARS.search(token):  # the token itself is never echoed
            raise ConfigError([(key, f"{path}: the token holds a control character (one line expected)")])
        return token


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration_seconds(v: str) -> float:
    """A duration in seconds: ``"5m"``, ``"30s"``, ``"1h"``, ``"500ms"`` or bare seconds; ValueError otherwise (the
    seed's config durations, ``gemini_context_cache.ttl``, flow control's ``x-llm-d-inference-ttl`` header)."""
    m = _DURATION.match(v)
    if m is None:
        raise ValueError(f"{v!r} is not a duration (a number of seconds, or e.g. '500ms', '30s', '5m', '1h')")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _seconds(v: object) -> object:
    """The seed's durations: ``"5m"``, ``"30s"``, ``"1h"``, ``"500ms"``, or a number of seconds."""
    return duration_seconds(v) if isinstance(v, str) else v


Duration = Annotated[float, BeforeValidator(_seconds), Field(gt=0, le=30 * 86_400)]


# The Redis KV index's keys (kv_cache_index.backend redis) on the response cache's server: a response_cache.redis
# key_prefix inside them is refused; one that covers them (e.g. "cr:") is fine, the cache's clear skips them
KV_INDEX_KEY_PREFIX = "cr:kvidx:"


class RedisConfig(_Section):
    """Tier 3: the Redis/Valkey connection the response cache and the Redis KV index share (one pool)."""

    url: str = "redis://127.0.0.1:6379"  # rediss:// for TLS (or tls: true)
    tls: bool = False
    pool_size: int = Field(8, ge=1, le=1024)
    key_prefix: str = "cr:resp:"  # no glob characters (*?[]): clear() deletes by this prefix
    connect_timeout_ms: int = Field(3000, ge=10, le=60_000)
    command_timeout_ms: int = Field(1000, ge=1, le=60_000)  # the longest a request waits on Redis
    fallback_capacity: int = Field(1000, ge=1, le=10_000_000)
    fallback_ttl_seconds: int = Field(300, ge=1, le=30 * 86_400)
    fallback_to_memory: bool = True
    health_check_interval_seconds: float = Field(30.0, gt=0, le=3600)  # while on the fallback: retry Redis
    # single: one server (the URL's). sentinel: the primary that the sentinels name (the URL gives credentials,
    # db and TLS; its host is not used). cluster: Valkey/Redis Cluster, the URL's host (and startup_nodes) the
    # nodes it is discovered from. See docs/picker.md, "Redis modes: single, Sentinel, Cluster".
    mode: Literal["single", "sentinel", "cluster"] = "single"
    sentinels: list[str] = Field(default_factory=list, max_length=16)  # host:port of each sentinel
    sentinel_master: str = Field("mymaster", min_length=1, max_length=128)  # the monitored primary's name
    startup_nodes: list[str] = Field(default_factory=list, max_length=64)  # more cluster nodes (host:port)

    @field_validator("sentinels", "startup_nodes")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for item in v:
            host_port(item)
        return v

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        if not re.match(r"^rediss?://[^\s]+$", v):
            raise ValueError("url must be redis://host:port[/db] or rediss://host:port[/db]")
        return v

    @field_validator("key_prefix")
    @classmethod
    def _no_glob(cls, v: str) -> str:
        if not v or any(c in v for c in "*?[]") or any(c.isspace() for c in v) or len(v) > 64:
            raise ValueError("key_prefix: 1-64 characters, no glob characters (*?[]) and no spaces")
        if v.startswith(KV_INDEX_KEY_PREFIX):  # the cache's keys would mix with the index's hashes
            raise ValueError(f"key_prefix must not be inside the Redis KV index's keys ({KV_INDEX_KEY_PREFIX}*)")
        return v


def host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as a pair; ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or any(c.isspace() or c in "/@" for c in host) or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: the port must be 1-65535")
    return host, int(port)


def redis_mode_problems(cfg: RedisConfig, path: str = "response_cache.redis") -> list[tuple[str, str]]:
    """What ``cfg.mode`` needs that ``cfg`` lacks (or has and must not), each with the path of the bad key."""
    out: list[tuple[str, str]] = []
    if cfg.mode == "sentinel" and not cfg.sentinels:
        out.append((f"{path}.sentinels", "mode sentinel needs the sentinels' addresses (host:port, one or more)"))
    if cfg.mode != "sentinel" and cfg.sentinels:
        out.append((f"{path}.sentinels", f"only read with mode sentinel (mode is {cfg.mode})"))
    if cfg.mode != "cluster" and cfg.startup_nodes:
        out.append((f"{path}.startup_nodes", f"only read with mode cluster (mode is {cfg.mode})"))
    if cfg.mode != "single" and urllib.parse.urlsplit(cfg.url).query:
        out.append(
            (f"{path}.url", f"query options (?ssl_ca_certs=...) are read in mode single only, not in mode {cfg.mode}")
        )
    if cfg.mode == "cluster":
        db = urllib.parse.urlsplit(cfg.url).path.strip("/")
        if db not in ("", "0"):
            out.append((f"{path}.url", f"a cluster has database 0 only: the URL's path must be /0 or empty, not /{db}"))
    return out


class SemanticCacheConfig(_Section):
    """Tier 2's semantic (similarity) cache, opt-in: one embedding per eligible miss."""

    enabled: bool = False
    backend: str | None = None  # base URL of the embeddings server (POST {backend}/v1/embeddings)
    embedding_model: str | None = None
    threshold: float = Field(0.92, gt=0.0, le=1.0)  # cosine similarity
    max_entries: int = Field(1000, ge=1, le=1_000_000)
    ttl: Duration | None = None  # None: response_cache.ttl
    embedding_timeout_ms: int = Field(2000, ge=100, le=60_000)
    max_input_bytes: int = Field(8192, ge=1, le=1_048_576)  # a longer last user message skips this path
    # The caller's identity, part of every partition (its SHA-256; the raw value is never kept): a request
    # without it skips the semantic path. With the default, Anthropic's x-api-key counts when authorization is
    # absent. Behind a gateway, name a header the gateway sets from the authenticated principal (and strips
    # from clients): a client-set header (like extproc.tenant_header) is only as trustworthy as the client.
    identity_header: Annotated[str, AfterValidator(_header_name)] = "authorization"
    # the index: vector bytes (float32, 4 per dimension) held, and entries compared per lookup (the partition's
    # most recent); the oldest entries are evicted past max_bytes as past max_entries
    max_bytes: int = Field(64 << 20, ge=1 << 16, le=1 << 40)
    max_scan: int = Field(1000, ge=1, le=1_000_000)
    # the embeddings breaker: this many consecutive failures (timeouts included) open it; the semantic path is
    # then skipped without a request for breaker_cooldown_ms, then one probe request is let through
    breaker_failures: int = Field(5, ge=1, le=1000)
    breaker_cooldown_ms: int = Field(10_000, ge=100, le=3_600_000)

    @field_validator("backend")
    @classmethod
    def _backend_url(cls, v: str | None) -> str | None:
        # the picker has no named backends of its own: the embeddings server is a base URL, refused otherwise
        # (a name such as the seed's "embedder" would make every embedding fail: a silent plain miss)
        if v is not None and not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", v):
            raise ValueError("backend must be the embeddings server's base URL: http(s)://host:port[/path]")
        return v

    @model_validator(mode="after")
    def _needs_backend(self) -> SemanticCacheConfig:
        if self.enabled and (not self.backend or not self.embedding_model):
            raise ValueError("semantic.enabled needs backend (the embeddings server's URL) and embedding_model")
        return self


# response headers a cache entry never holds, whatever response_cache.stored_headers says: hop-by-hop and framing
# headers, per-response ones (set-cookie, date), the cache's own answer headers, content-encoding (an encoded
# response is never stored), pseudo-headers and what Envoy or the picker set on the way out
NEVER_STORED_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "set-cookie", "date", "x-cache", "x-cache-mode", "content-encoding",
    }
)  # fmt: skip
NEVER_STORED_PREFIXES = (":", "x-envoy-", "x-kv-epp-")
MAX_STORED_HEADERS = 64


def _stored_header(v: str) -> str:
    """A ``response_cache.stored_headers`` entry: an HTTP header name, lower-cased, that may be replayed."""
    name = v.lower()
    if name.startswith(NEVER_STORED_PREFIXES) or name in NEVER_STORED_HEADERS:
        raise ValueError(
            f"{name!r} is never stored (hop-by-hop, framing, per-response, the cache's own or set by Envoy/the picker)"
        )
    return _header_name(name)


StoredHeader = Annotated[str, AfterValidator(_stored_header)]


class ResponseCacheConfig(_Section):
    """Tier 2: whole responses of deterministic requests (temperature 0 or absent), answered by the picker.
    ``backend`` is restart-required; the other keys hot-reloadable.

    ``stored_headers``: the only response headers an entry keeps and a hit replays (an allow-list, names
    lower-cased): any other header an engine or gateway adds (an id, a session token, a per-caller value) is
    dropped before the entry reaches the store. At most 64 names; ``NEVER_STORED_HEADERS`` and names starting
    with ``:``, ``x-envoy-`` or ``x-kv-epp-`` are refused."""

    enabled: bool = False
    backend: Literal["memory", "redis"] = "memory"
    capacity: int = Field(1000, ge=1, le=10_000_000)  # entries, LRU
    ttl: Duration = 300.0
    max_response_size: int = Field(1 << 20, ge=1, le=1 << 30)
    max_stream_buffer_size: int = Field(10 << 20, ge=1, le=1 << 30)
    stored_headers: tuple[StoredHeader, ...] = Field(
        ("content-type", "content-language"), max_length=MAX_STORED_HEADERS
    )  # the response headers an entry keeps and a hit replays (an allow-list)
    semantic: SemanticCacheConfig = SemanticCacheConfig()
    redis: RedisConfig = RedisConfig()


class Settings(BaseSettings):
    """The whole picker configuration."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, extra="forbid", frozen=True
    )

    selection_strategy: StrategyName = "RoundRobin"
    prefix_routing: PrefixRoutingConfig = PrefixRoutingConfig()
    kv_cache_index: KvCacheIndexConfig = KvCacheIndexConfig()
    session_affinity: SessionAffinityConfig = SessionAffinityConfig()
    pool: PoolConfig = PoolConfig()
    extproc: ExtProcConfig = ExtProcConfig()
    admission: AdmissionConfig = AdmissionConfig()
    flow_control: FlowControlConfig = FlowControlConfig()
    admin: AdminConfig = AdminConfig()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    gemini_context_cache: GeminiContextCacheConfig = GeminiContextCacheConfig()
    experiments: ExperimentsConfig = ExperimentsConfig()
    # InferenceModelRewrites of the config (hot-reloadable), applied with the watched ones
    model_rewrites: tuple[ModelRewriteConfig, ...] = Field((), max_length=MAX_MODEL_REWRITES)
    # with pool.inference_pool: watch InferenceModelRewrite objects whose poolRef is ours (restart-required)
    watch_model_rewrites: bool = True
    metrics: MetricsConfig = MetricsConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    shared_load: SharedLoadConfig = SharedLoadConfig()  # restart-required

    @field_validator("model_rewrites")
    @classmethod
    def _unique_rewrite_names(cls, v: tuple[ModelRewriteConfig, ...]) -> tuple[ModelRewriteConfig, ...]:
        seen: dict[str, int] = {}
        for i, rw in enumerate(v):
            if rw.name in seen:
                raise ValueError(f"[{i}].name {rw.name!r} is the name of [{seen[rw.name]}] too: names are unique")
            seen[rw.name] = i
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings  # the environment overrides the file


def parse_settings(data: dict[str, Any]) -> Settings:
    """Validate a config mapping (plus the ``KV_EPP_*`` environment); raise ConfigError naming the
    path of every bad key, or the environment variable whose value is not JSON."""
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc)) from None
    except SettingsError as exc:
        cause = exc.__cause__
        raise ConfigError(_environment_problems(f"{exc} ({cause})" if cause else str(exc))) from None
    except TypeError as exc:  # a key that is not a string (read_yaml_mapping refuses those already)
        raise ConfigError([("<root>", f"section names must be strings ({exc})")]) from None
    except RecursionError:  # an environment value (JSON) nested thousands of levels deep
        raise ConfigError(_environment_problems("a value is nested too deeply")) from None
    problems = [*_control_characters(settings.model_dump(), ""), *_cross_section_problems(settings)]
    if problems:
        raise ConfigError(problems)
    return settings


def _control_characters(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string of the config (addresses, names, header names, paths, tokens) with a control
    character (CR/LF would split a header or a log line; none belongs in a config value)."""
    if isinstance(value, str):
        m = CONTROL_CHARS.search(value)
        if m:  # the value itself is not echoed: it may be a secret (admin.bearer_token)
            yield (
                path or "<root>",
                f"control character {m.group()!r} at position {m.start()}: not allowed in a config value",
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _control_characters(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _control_characters(v, f"{path}[{i}]")


def _cross_section_problems(s: Settings) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if s.admission.max_buffered_body_bytes < s.extproc.max_body_bytes:
        out.append(
            (
                "admission.max_buffered_body_bytes",
                f"{s.admission.max_buffered_body_bytes} is below extproc.max_body_bytes "
                f"({s.extproc.max_body_bytes}): a body of the allowed size could never be admitted",
            )
        )
    exposed = unauthenticated_exposure(s.extproc, loopback_host(s.extproc.host))  # a name: checked at start
    if exposed is not None:
        out.append(exposed)
    out += redis_mode_problems(s.response_cache.redis)
    return out + arm_problems(s) + _pool_source_problems(s)


def arm_problems(s: Settings) -> list[tuple[str, str]]:
    """Every experiment arm's overlay checked against ``s`` (``arm_settings``): the problems, with their paths."""
    out: list[tuple[str, str]] = []
    for name, arm in s.experiments.arms.items():
        try:
            arm_settings(s, name, arm)
        except ConfigError as exc:
            out.extend(exc.problems)
    return out


def _pool_source_problems(s: Settings) -> list[tuple[str, str]]:
    """At most one pool source; feeds that match it (a static list for a static pool, a template for a
    discovered one)."""
    pool, kv = s.pool, s.kv_cache_index
    given = [
        key
        for key, on in (
            ("backends", bool(pool.engines)),
            ("inference_pool", pool.inference_pool is not None),
            ("backends_file", pool.backends_file is not None),
        )
        if on
    ]
    out: list[tuple[str, str]] = []
    if len(given) > 1:
        out.append(
            (
                f"pool.{given[1]}",
                f"the pool has one source: pool.{given[0]} is set already (set one of pool.backends, "
                "pool.inference_pool, pool.backends_file)",
            )
        )
    if pool.discovered and kv.event_sources:
        out.append(
            (
                "kv_cache_index.event_sources",
                f"the pool is discovered (pool.{pool.source}): its backends' feeds come from "
                "kv_cache_index.event_source_template, e.g. {endpoint: 'http://listener:7817/events/{name}'}",
            )
        )
    if not pool.discovered and kv.event_source_template is not None:
        out.append(
            (
                "kv_cache_index.event_source_template",
                "applies to a discovered pool (pool.inference_pool or pool.backends_file); a static pool lists "
                "kv_cache_index.event_sources",
            )
        )
    return out


def _environment_problems(otherwise: str) -> list[tuple[str, str]]:
    """Which ``KV_EPP_*`` variable pydantic-settings could not parse (a section or list given as JSON)."""
    problems = []
    for name, value in sorted(os.environ.items()):
        if not name.upper().startswith(ENV_PREFIX) or not _parsed_as_json(name[len(ENV_PREFIX) :]):
            continue
        try:
            json.loads(value)
        except ValueError as err:
            problems.append((name, f"not valid JSON ({err}); a section or list is given as JSON, e.g. '{{}}' or '[]'"))
        except RecursionError:
            problems.append((name, "JSON nested too deeply"))
    return problems or [(ENV_PREFIX + "*", otherwise)]


def _parsed_as_json(var: str) -> bool:
    """True when the variable ``KV_EPP_<var>`` names a section or a list (its value is decoded as JSON)."""
    model: type[BaseModel] = Settings
    field = None
    for part in var.lower().split(ENV_NESTED_DELIMITER):
        if field is not None:  # a path below a field that is not a section
            return False
        info = model.model_fields.get(part)
        if info is None:
            return False
        ann = _without_none(info.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            field = ann
    return field is None or get_origin(field) in (tuple, list, dict)


def _without_none(ann: Any) -> Any:
    """``X`` for ``X | None`` (an optional section is still a section), else ``ann``."""
    args = [a for a in get_args(ann) if a is not type(None)]
    if get_origin(ann) in (Union, UnionType) and len(args) == 1:
        return args[0]
    return ann


def load_settings(path: str | Path | None) -> Settings:
    """Load the YAML file at ``path`` (or defaults + environment when None)."""
    return parse_settings({} if path is None else read_yaml_mapping(path))


def config_warnings(s: Settings) -> list[tuple[str, str]]:
    """The seed's warnings: legal but probably not what the operator meant."""
    out: list[tuple[str, str]] = []
    if s.selection_strategy in ("PrefixAwareHash", "PrefixMemory") and not s.prefix_routing.enabled:
        out.append(
            (
                "selection_strategy",
                f"{s.selection_strategy} with prefix_routing.enabled=false hashes the model name only: "
                "every request of a model goes to one backend, without a load bound",
            )
        )
    sem = s.response_cache.semantic
    if s.response_cache.enabled and sem.enabled and sem.embedding_timeout_ms > 5000:
        out.append(
            (
                "response_cache.semantic.embedding_timeout_ms",
                f"{sem.embedding_timeout_ms} ms is longer than Envoy's ext_proc message timeout as kv-epp generates "
                "it by default (5000 ms, `kv-epp envoy-config --message-timeout-ms`): a slow embedding would time the "
                "request out in Envoy first; raise that too (`kv-epp envoy-config --picker-config` does)",
            )
        )
    fc = s.flow_control
    if fc.enabled:
        longest = max(fc.default_ttl_ms, fc.no_endpoints_ttl_ms)
        if longest >= 4000:
            out.append(
                (
                    "flow_control.default_ttl_ms",
                    f"a request may wait up to {longest} ms in flow control: Envoy's ext_proc message timeout must be "
                    "longer (5000 ms as kv-epp generates it by default; `kv-epp envoy-config --picker-config` derives "
                    "it), or a queued request times out in Envoy first",
                )
            )
        if fc.max_requests > s.admission.max_open_streams:
            out.append(
                (
                    "flow_control.max_requests",
                    f"{fc.max_requests} queued requests need as many open streams, but admission.max_open_streams is "
                    f"{s.admission.max_open_streams}: past it requests are refused 429 before they can queue",
                )
            )
    ip = s.pool.inference_pool
    if ip is not None and ip.watch_idle_timeout_seconds < 65:
        out.append(
            (
                "pool.inference_pool.watch_idle_timeout_seconds",
                f"{ip.watch_idle_timeout_seconds:g} s is below the API server's bookmark period (about 60 s): every "
                "quiet watch is renewed at that pace, a request each time, from every picker",
            )
        )
    kv = s.kv_cache_index
    if kv.enabled and s.prefix_routing.enabled:
        if kv.scoring.gpu_tier_weight < kv.scoring.min_overlap_threshold:
            out.append(
                (
                    "kv_cache_index.scoring.gpu_tier_weight",
                    "gpu_tier_weight below min_overlap_threshold: no backend can pass the threshold, "
                    "Tier 4 always falls back to the selection strategy",
                )
            )
        if (
            s.kv_cache_index.storage_offloading.enabled
            and kv.scoring.storage_tier_weight < kv.scoring.min_overlap_threshold
        ):
            out.append(
                (
                    "kv_cache_index.scoring.storage_tier_weight",
                    "storage_tier_weight below min_overlap_threshold: StorageWarm-only holders are never scored",
                )
            )
    if kv.enabled and not s.prefix_routing.enabled:
        out.append(
            (
                "kv_cache_index.enabled",
                "Tier 4 runs only when prefix_routing.enabled is also true",
            )
        )
    if kv.enabled and not kv.event_sources and kv.event_source_template is None:
        key = "event_source_template" if s.pool.discovered else "event_sources"
        out.append((f"kv_cache_index.{key}", "no event sources: the KV index stays empty"))
    if kv.enabled and kv.tokenizer.source == "none":
        out.append(("kv_cache_index.tokenizer.source", "source none: requests have no block keys"))
    if not s.pool.engines and not s.pool.discovered and not s.pool.gemini:
        out.append(("pool.backends", "no backends: every request is answered 503"))
    out.extend(_shadowed_rewrite_rules(s))
    out.extend(not_implemented_warnings(s))
    if s.response_cache.enabled:
        out.append(
            (
                "response_cache.enabled",
                "responses are stored only when their bodies reach the picker: Envoy's response mode full (what "
                "kv-epp envoy-config --picker-config derives) or sampled with --body-mode BUFFERED; an Envoy in mode "
                "none answers hits but stores nothing (warned at the first eligible miss; /readyz response_cache says "
                "whether bodies arrive)",
            )
        )
    if s.admin.enabled and s.admin.host not in ("127.0.0.1", "::1", "localhost") and not s.admin.has_token:
        out.append(("admin.bearer_token", "admin listens beyond loopback without a bearer token"))
    x = s.extproc
    if x.auth.allow_unauthenticated and not x.client_authentication and loopback_host(x.host) is False:
        out.append(
            (
                "extproc.auth.allow_unauthenticated",
                f"ext_proc on {x.host!r} without client authentication (no extproc.auth.token_file, no "
                "extproc.tls.client_ca_file): anyone who reaches the port can open streams, hold in-flight leases "
                "and steer routing; restrict who reaches it (a NetworkPolicy, a firewall)",
            )
        )
    if 0 < x.max_streams_per_peer < s.admission.max_open_streams:
        out.append(
            (
                "extproc.max_streams_per_peer",
                f"{x.max_streams_per_peer} is below admission.max_open_streams ({s.admission.max_open_streams}): "
                "one Envoy (a sidecar's only peer) is refused with a gRPC error (Envoy answers 500) before admission "
                "would answer 429; intended only when several Envoys share this picker",
            )
        )
    if x.tls.mode == "plaintext" and loopback_host(x.host) is not True and not x.auth.token_file:
        out.append(
            (
                "extproc.tls.mode",
                "plaintext ext_proc beyond loopback without extproc.auth.token_file: anyone who reaches the port "
                "can open streams and steer routing",
            )
        )
    return out


def _shadowed_rewrite_rules(s: Settings) -> list[tuple[str, str]]:
    """Config rewrite rules that never apply: a model an earlier rule matches exactly, a second generic rule."""
    out: list[tuple[str, str]] = []
    first: dict[str | None, str] = {}  # a matched model (None: the generic rule) → the rule that claims it
    for i, rw in enumerate(s.model_rewrites):
        for j, rule in enumerate(rw.rules):
            at = f"model_rewrites[{i}].rules[{j}]"
            for k, model in enumerate([m.model.value for m in rule.matches] or [None]):
                claimed = first.setdefault(model, at)
                if claimed == at:
                    continue
                if model is None:
                    out.append((at, f"never applies: {claimed} is an earlier generic rule (the first one wins)"))
                else:
                    out.append((f"{at}.matches[{k}]", f"never applies: {claimed} matches {model!r} first"))
    return out


def not_implemented_warnings(s: Settings) -> list[tuple[str, str]]:
    """Keys of the seed that are accepted so configs stay portable, but change nothing yet."""
    out: list[tuple[str, str]] = []
    kv = s.kv_cache_index
    for key in sorted(kv.storage_offloading.model_fields_set):
        out.append(
            (
                f"kv_cache_index.storage_offloading.{key}",
                f"{NOT_IMPLEMENTED} (Tier 4 storage tiers): the picker scores the tiers its listener feed "
                "reports; whether an eviction is an offload is the listener's sources[].treat_eviction_as_offload",
            )
        )
    return out


def settings_json_schema() -> dict[str, Any]:
    """JSON Schema (draft-07, as Helm's values.schema.json wants) of the picker's YAML file, from ``Settings``.

    It checks names, types, ranges and enums; cross-field rules (weights summing to 1.0, unique backend
    names, host:port syntax) are checked by ``kv-epp config validate`` only.
    """
    schema = Settings.model_json_schema(ref_template="#/definitions/{model}")
    defs = schema.pop("$defs", {})
    out: dict[str, Any] = {"$schema": "http://json-schema.org/draft-07/schema#", **schema}
    if defs:
        out["definitions"] = defs
    return out


def restart_required_changes(old: Settings, new: Settings) -> list[str]:
    """What changed but cannot be applied without a restart: top-level sections (``kv_cache_index``, ...),
    then keys of hot sections (``pool.inference_pool``, ``pool.backends_file``: the discovery source)."""
    out = [
        name
        for name in Settings.model_fields
        if name not in HOT_RELOADABLE and getattr(old, name) != getattr(new, name)
    ]
    for section, key in RESTART_REQUIRED_KEYS:
        if getattr(getattr(old, section), key) != getattr(getattr(new, section), key):
            out.append(f"{section}.{key}")
    return out
