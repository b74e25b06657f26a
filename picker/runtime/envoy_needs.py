"""What the picker's config needs of Envoy: ``kv-epp envoy-config --picker-config FILE`` derives each flag a
feature needs, and refuses an explicit flag that would silently disable one.
See docs/picker.md, "Envoy's configuration".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from picker.runtime.envoy_config import BodyMode, EnvoyOptions, ResponseMode
from picker.runtime.envoy_options import ExternalUpstream

if TYPE_CHECKING:
    from picker.config import Settings

FULL_DUPLEX: BodyMode = "FULL_DUPLEX_STREAMED"
DEFAULT_PICKER = "127.0.0.1:9002"
_DEFAULTS = EnvoyOptions()

# The response mode the response cache needs: every eligible miss's body reaches the picker. ``sampled`` does too
# with BUFFERED request bodies (each eligible miss is switched to a streamed body, like an opted-in sample).
CACHE_RESPONSE_MODE: ResponseMode = "full"
CACHE_ALSO_WORKS = "sampled with BUFFERED request bodies"
# What ``full`` costs (docs/operations.md, "Response modes and what they cost": benchmarks.overhead --compare-modes)
FULL_MODE_COST = (
    "every response body chunk passes through the picker (measured: about 10.7 ms of picker CPU per streamed "
    "256-token response against 0.6 ms with none)"
)
FLOW_MARGIN_MS = 1000  # a dispatched request's decide, commit and answer after its wait
SEMANTIC_MARGIN_MS = 1000  # the message timeout above the embedding's: the rest of the request path


class Refused(ValueError):
    """A flag that cannot serve a feature the picker's config turns on: one line naming both."""


@dataclass(frozen=True, slots=True)
class Given:
    """The ``envoy-config`` flags as given on the command line (None: not given)."""

    mode: str = "sidecar"
    picker: str | None = None
    body_mode: BodyMode | None = None
    response_mode: ResponseMode | None = None
    plaintext: bool = False
    ca: str | None = None
    sni: str | None = None
    client_cert: str | None = None
    token: str | None = None  # the token read from --picker-token-file
    token_file: str | None = None
    message_timeout_ms: int | None = None
    retries: int | None = None


@dataclass(slots=True)
class Derived:
    """EnvoyOptions fields (``options``), what was derived (``notes``) and what is doubtful (``warnings``): the
    last two are stderr lines."""

    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed), as the picker reads it; ValueError if it
    cannot be read or is not printable ASCII without spaces (the token itself is never in the message)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    if not token or any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError(f"{path}: the token must be printable ASCII without spaces")
    return token


def sampling_configured(s: Settings) -> bool:
    """Response sampling is asked for in the file (or environment): a positive ``extproc.response_sample_rate``
    or an opt-in ``extproc.response_sample_header`` set there. Their defaults alone ask for nothing: they take
    effect only with ``--response-mode sampled``."""
    x = s.extproc
    given = x.model_fields_set
    return ("response_sample_rate" in given and x.response_sample_rate > 0) or "response_sample_header" in given


def derive(s: Settings | None, g: Given, source: str = "--picker-config") -> Derived:
    """The EnvoyOptions fields the flags ``g`` and the picker's config ``s`` call for (``s`` None: no picker
    config, the flags and the defaults only). Raises ``Refused`` for a combination that cannot work."""
    out = Derived()
    on_picker = s is not None and g.mode != "no-picker"
    body, response = g.body_mode, g.response_mode
    if on_picker:
        assert s is not None
        response = _response_mode(s, g, out, source)
        _picker_address(s, g, out, source)
        _picker_tls(s, g, out, source)
        _message_timeout(s, g, out, source)
        _retries(s, g, out, source)
        _external(s, out, source)
    if response == "sampled":
        if body == FULL_DUPLEX:
            raise Refused(
                "--response-mode sampled needs --body-mode BUFFERED: Envoy ignores a per-request mode override when a "
                "body mode is FULL_DUPLEX_STREAMED (give --response-mode full or none with full-duplex bodies)"
            )
        if body is None:
            body = "BUFFERED"
            out.notes.append("body mode BUFFERED: response mode sampled needs it (Envoy's per-request mode override)")
    body = body or FULL_DUPLEX
    out.options["body_mode"] = body
    out.options["response_mode"] = response or "none"
    if on_picker and body == "BUFFERED":
        assert s is not None
        need = s.extproc.max_body_bytes + (1 << 20)  # Envoy holds the whole body: the picker, not a 413, refuses it
        if need > _DEFAULTS.buffer_limit_bytes:
            out.options["buffer_limit_bytes"] = need
            out.notes.append(
                f"Envoy's buffer limit {need} bytes: extproc.max_body_bytes is {s.extproc.max_body_bytes} and "
                "BUFFERED mode holds the whole request body in Envoy"
            )
    out.options.setdefault(
        "message_timeout_ms", _DEFAULTS.message_timeout_ms if g.message_timeout_ms is None else g.message_timeout_ms
    )
    out.options.setdefault("retries", _DEFAULTS.retries if g.retries is None else g.retries)
    return out


def _external(s: Settings, out: Derived, source: str) -> None:
    """A cluster and a route per ``type: gemini`` backend (its host alone resolved by DNS, TLS unless the backend
    allows http for a local fake)."""
    ups = tuple(ExternalUpstream.of(b) for b in s.pool.gemini)
    if ups:
        out.options["external_upstreams"] = ups
        out.notes.append(
            f"external upstreams {', '.join(f'{u.cluster} ({u.host}:{u.port})' for u in ups)}: the type: gemini "
            f"backends of {source}"
        )


def native_conversion(s: Settings) -> bool:
    """Responses of a gemini backend are converted to the OpenAI shape by the picker (the native API is used)."""
    return bool(s.pool.gemini) and s.gemini_context_cache.prefer_native_api


def _response_mode(s: Settings, g: Given, out: Derived, source: str) -> ResponseMode | None:
    if native_conversion(s):
        if g.response_mode not in (None, "full"):
            raise Refused(
                f"--response-mode {g.response_mode}: gemini_context_cache.prefer_native_api is true in {source} with "
                "type: gemini backends, and the picker converts their native responses to the OpenAI shape, so every "
                "response body must pass through it: leave --response-mode out or give full"
            )
        if g.response_mode is None:
            out.notes.append(
                f"response mode full: {source} sends chat completions to gemini backends' native API and the "
                f"picker converts the responses; cost: {FULL_MODE_COST}"
            )
            return "full"
    cache = s.response_cache.enabled
    sampling = sampling_configured(s)
    rm = g.response_mode
    if rm is None:
        if cache:
            note = (
                f"response mode {CACHE_RESPONSE_MODE}: response_cache.enabled is true in {source} and a miss is "
                f"stored only from a response body that reaches the picker; cost: {FULL_MODE_COST}"
            )
            if g.body_mode == "BUFFERED":
                note += "; --response-mode sampled also stores every miss and streams only misses and the sample"
            out.notes.append(note)
            return CACHE_RESPONSE_MODE
        if sampling:
            if g.body_mode == FULL_DUPLEX:
                raise Refused(
                    f"response sampling is on in {source} (extproc.response_sample_rate or response_sample_header) "
                    "and needs --response-mode sampled, which needs --body-mode BUFFERED: leave --body-mode out, "
                    "or give --response-mode full (every response read) or none (no sample)"
                )
            out.notes.append(
                f"response mode sampled: response sampling is on in {source} (extproc.response_sample_rate "
                f"{s.extproc.response_sample_rate:g}, header {s.extproc.response_sample_header}); each sampled "
                "response streams its body through the picker"
            )
            return "sampled"
        return None
    if rm == "none" and cache:
        raise Refused(
            f"--response-mode none stores nothing while response_cache.enabled is true in {source} (every cacheable "
            f"request would be a MISS): leave --response-mode out ({CACHE_RESPONSE_MODE} is derived) or give full "
            "(or sampled with --body-mode BUFFERED)"
        )
    if rm == "sampled" and cache and g.body_mode == FULL_DUPLEX:
        raise Refused(
            f"--response-mode sampled with --body-mode FULL_DUPLEX_STREAMED stores nothing while "
            f"response_cache.enabled is true in {source} (Envoy ignores the mode override that streams a miss's "
            "body): give --response-mode full, or --body-mode BUFFERED"
        )
    if rm == "none" and sampling:
        raise Refused(
            f"--response-mode none reads no response body while response sampling is on in {source} "
            "(extproc.response_sample_rate or response_sample_header): leave --response-mode out (sampled is "
            "derived) or give sampled (BUFFERED bodies) or full"
        )
    return rm


def _picker_address(s: Settings, g: Given, out: Derived, source: str) -> None:
    """Sidecar without ``--picker``: the picker's own ``extproc.host:port`` (a wildcard host as loopback)."""
    if g.mode != "sidecar" or g.picker is not None:
        return
    host, port = s.extproc.host, s.extproc.port
    if port == 0:
        raise Refused(f"extproc.port is 0 in {source} (the picker takes a free port at start): give --picker HOST:PORT")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    out.options["picker_address"] = address
    if address != DEFAULT_PICKER:
        out.notes.append(f"picker address {address}: extproc.host and extproc.port of {source}")


def _picker_tls(s: Settings, g: Given, out: Derived, source: str) -> None:
    """TLS or plaintext as the picker speaks; its client certificate and token requirements."""
    tls = s.extproc.tls
    if tls.mode == "plaintext":
        if g.ca or g.sni or g.client_cert:
            raise Refused(
                f"--picker-ca, --picker-sni and --picker-client-cert need TLS, and extproc.tls.mode is plaintext in "
                f"{source}: leave them out"
            )
        out.options["picker_tls"] = False
        if not g.plaintext:
            out.notes.append(f"plaintext to the picker: extproc.tls.mode is plaintext in {source}")
    else:
        if g.plaintext:
            raise Refused(
                f"--picker-plaintext: the picker speaks TLS (extproc.tls.mode is tls in {source}), so Envoy could "
                "open no ext_proc stream: leave the flag out"
            )
        if tls.client_ca_file is not None and g.client_cert is None:
            raise Refused(
                f"extproc.tls.client_ca_file is set in {source}: the picker requires a client certificate, give "
                "--picker-client-cert FILE --picker-client-key FILE (one its CA signs)"
            )
    token_file = s.extproc.auth.token_file
    if token_file is None:
        return
    try:
        token: str | None = read_token(token_file)
        why = ""
    except ValueError as exc:
        token, why = None, str(exc)
    if g.token is None:
        if token is None:
            raise Refused(
                f"extproc.auth.token_file is set in {source} but cannot be read here ({why}): give "
                "--picker-token-file FILE with the picker's token"
            )
        out.options["picker_token"] = token
        out.notes.append(
            f"Envoy sends the token of extproc.auth.token_file ({token_file}) to the picker: the printed bootstrap "
            "holds it, store it like a Secret"
        )
    elif token is not None and token != g.token:
        raise Refused(
            f"--picker-token-file {g.token_file}: its token is not the one in extproc.auth.token_file ({token_file}) "
            f"of {source}, so the picker would refuse every stream"
        )


def _message_timeout(s: Settings, g: Given, out: Derived, source: str) -> None:
    """The picker answers some request messages only after a wait: the semantic cache's embedding, flow
    control's queue (up to the longest TTL). Envoy's message timeout must outlast the longest."""
    needs: list[tuple[int, str]] = []
    sem = s.response_cache.semantic
    if s.response_cache.enabled and sem.enabled:
        needs.append(
            (
                sem.embedding_timeout_ms + SEMANTIC_MARGIN_MS,
                f"response_cache.semantic.embedding_timeout_ms is {sem.embedding_timeout_ms} in {source} "
                f"(+{SEMANTIC_MARGIN_MS} ms for the rest of the request path)",
            )
        )
    fc = s.flow_control
    if fc.enabled:
        longest = max(fc.default_ttl_ms, fc.no_endpoints_ttl_ms)
        needs.append(
            (
                longest + FLOW_MARGIN_MS,
                f"a request may wait {longest} ms in flow control (flow_control.default_ttl_ms / "
                f"no_endpoints_ttl_ms in {source}; +{FLOW_MARGIN_MS} ms for the rest of the request path)",
            )
        )
    if not needs:
        return
    need, why = max(needs)
    if g.message_timeout_ms is None:
        if need > _DEFAULTS.message_timeout_ms:
            out.options["message_timeout_ms"] = need
            out.notes.append(f"ext_proc message timeout {need} ms: {why}")
    elif g.message_timeout_ms < need:
        out.warnings.append(
            f"--message-timeout-ms {g.message_timeout_ms} is below {need} ms: {why}; a request that waits that long "
            "times out in Envoy first (a 500, or fail-open)"
        )


def _retries(s: Settings, g: Given, out: Derived, source: str) -> None:
    """Envoy tries the picker's ranked fallbacks one retry each: at least ``pool.fallbacks`` retries."""
    fallbacks = s.pool.fallbacks
    if g.retries is None:
        if fallbacks > _DEFAULTS.retries:
            out.options["retries"] = fallbacks
            out.notes.append(f"retries {fallbacks}: pool.fallbacks is {fallbacks} in {source}")
    elif g.retries < fallbacks:
        out.warnings.append(
            f"--retries {g.retries} is below pool.fallbacks ({fallbacks}) of {source}: the last "
            f"{fallbacks - g.retries} ranked fallback(s) are never tried"
        )


# -- the picker's side: what its response cache needs, and what its streams showed --------------------------------
def response_cache_detail(s: Settings, miss_bodies: Mapping[str, int], stored: int) -> dict[str, object] | None:
    """``/readyz`` detail while the response cache is on (None otherwise): the Envoy response mode it needs to
    store anything, and what the ext_proc streams showed (``ResponseCache.miss_bodies``): whether eligible misses'
    response bodies reached the picker (``envoy_sends_response_bodies``: true, false, ``"some"`` when both were
    seen, e.g. two Envoys configured differently, or null before the first eligible miss ended). Detail only:
    never readiness."""
    if not s.response_cache.enabled:
        return None
    reached, missing = miss_bodies.get("reached", 0), miss_bodies.get("missing", 0)
    verdict: bool | str | None = None
    if reached or missing:
        verdict = "some" if reached and missing else bool(reached)
    detail: dict[str, object] = {
        "needs_response_mode": CACHE_RESPONSE_MODE,
        "also_works": CACHE_ALSO_WORKS,
        "envoy_sends_response_bodies": verdict,
        "eligible_miss_bodies": {"reached": reached, "missing": missing},
        "stored": stored,
    }
    if verdict is not None and verdict is not True:
        detail["problem"] = (
            f"{missing} eligible miss(es) ended without their response body reaching the picker (Envoy's response "
            f"mode none?): those are not stored; kv-epp envoy-config --picker-config derives {CACHE_RESPONSE_MODE}"
        )
    return detail


def response_cache_log_fields(s: Settings) -> str:
    """The start log's ``response_cache=off``, or ``response_cache=on needs_response_mode=full``."""
    if not s.response_cache.enabled:
        return "response_cache=off"
    return f"response_cache=on needs_response_mode={CACHE_RESPONSE_MODE}"
