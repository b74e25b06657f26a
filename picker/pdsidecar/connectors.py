"""The KV connectors' request rewriting, pure (no I/O): what each P/D leg's body is, made from the client's parsed
body, and the decode answer's ``cached_tokens`` rewrite. Chosen by name from ``CONNECTORS`` (``--kv-connector``).
The facts are llm-d's sidecar contract (docs/pd.md, "The routing sidecar").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

# Forced to 1 on a prefill leg, present or not (as llm-d does): the prefill engine computes the prompt's KV and one
# token, no more.
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
# Forced to 1 only when the client gave it: a min_tokens above the forced max_tokens is refused by vLLM.
MIN_TOKENS = "min_tokens"
KV_TRANSFER_PARAMS = "kv_transfer_params"
# NixlConnector's request to the prefill engine: compute the KV and keep it for a remote decode.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BadPrefillAnswer(Exception):
    """A prefill engine's 2xx answer the decode leg cannot be built from (not JSON, no transfer parameters)."""


@dataclass(frozen=True, slots=True)
class Target:
    """The prefill endpoint of one request: ``address`` the canonical ``ip:port``, ``host`` its IP (no brackets)."""

    address: str

    @property
    def host(self) -> str:
        host = self.address.rpartition(":")[0]
        return str(ipaddress.ip_address(host.strip("[]")))


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` for a prefill leg: not streamed, at most one token."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    for name in TOKEN_LIMITS:
        out[name] = 1
    if MIN_TOKENS in out:
        out[MIN_TOKENS] = 1
    return out


def dumps(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class NixlV2:
    """vLLM's NixlConnector: the prefill leg asks for a remote decode; the decode leg is the client's body with the
    ``kv_transfer_params`` of the prefill answer. The decode answer's cached_tokens is the prefill side's."""

    name: str = "nixlv2"
    concurrent: bool = False
    rewrites_cached_tokens: bool = True

    def prefill_body(self, body: dict[str, Any], target: Target, room: int) -> bytes:
        out = one_token(body)
        out[KV_TRANSFER_PARAMS] = dict(NIXL_PREFILL_PARAMS)
        return dumps(out)

    def decode_body(self, body: dict[str, Any], raw: bytes, target: Target, room: int, answer: bytes) -> bytes:
        params = transfer_params(answer)
        out = dict(body)
        out[KV_TRANSFER_PARAMS] = params
        return dumps(out)


@dataclass(frozen=True, slots=True)
class SharedStorage:
    """vLLM's ExampleConnector (shared storage): the prefill leg writes the prompt's KV to the shared path; the
    decode leg is the client's body, byte for byte, and the decode engine finds the KV there."""

    name: str = "shared-storage"
    concurrent: bool = False
    rewrites_cached_tokens: bool = False

    def prefill_body(self, body: dict[str, Any], target: Target, room: int) -> bytes:
        return dumps(one_token(body))

    def decode_body(self, body: dict[str, Any], raw: bytes, target: Target, room: int, answer: bytes) -> bytes:
        return raw


@dataclass(frozen=True, slots=True)
class SGLang:
    """SGLang's disaggregation: both legs carry the prefill host, its bootstrap port and one random room, and run at
    once (the decode engine pulls the KV from the room)."""

    bootstrap_port: int = 8998
    name: str = "sglang"
    concurrent: bool = True
    rewrites_cached_tokens: bool = False

    def bootstrap_body(self, body: dict[str, Any], target: Target, room: int) -> bytes:
        out = dict(body)
        out["bootstrap_host"] = target.host
        out["bootstrap_port"] = self.bootstrap_port
        out["bootstrap_room"] = room
        return dumps(out)

    def prefill_body(self, body: dict[str, Any], target: Target, room: int) -> bytes:
        return self.bootstrap_body(body, target, room)

    def decode_body(self, body: dict[str, Any], raw: bytes, target: Target, room: int, answer: bytes) -> bytes:
        return self.bootstrap_body(body, target, room)


Connector = NixlV2 | SharedStorage | SGLang


# --kv-connector's names, each with how to make it from the sglang bootstrap port.
CONNECTORS: dict[str, Callable[[int], Connector]] = {
    "nixlv2": lambda _: NixlV2(),
    "shared-storage": lambda _: SharedStorage(),
    "sglang": lambda bootstrap_port: SGLang(bootstrap_port=bootstrap_port),
}


def make_connector(name: str, sglang_bootstrap_port: int = 8998) -> Connector:
    """The connector ``--kv-connector`` names (ValueError for another name)."""
    factory = CONNECTORS.get(name)
    if factory is None:
        raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(CONNECTORS)}")
    return factory(sglang_bootstrap_port)


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request or answer body as a JSON object; ValueError saying what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"the body is JSON but not an object (a {type(body).__name__})")
    return body


def transfer_params(answer: bytes) -> Any:
    """The ``kv_transfer_params`` of a NixlConnector prefill answer; BadPrefillAnswer when there are none (the
    prefill engine has no KV connector: a decode leg without them would silently prefill locally)."""
    try:
        parsed = parse_object(answer)
    except ValueError as exc:
        raise BadPrefillAnswer(f"the prefill answer: {exc}") from None
    params = parsed.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict):
        raise BadPrefillAnswer(
            "the prefill answer has no kv_transfer_params object (is the prefill engine's kv_connector"
            " NixlConnector with kv_role kv_producer or kv_both?)"
        )
    return params


def cached_tokens(answer: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer; 0 when absent (vLLM gives null details for 0)."""
    try:
        parsed = parse_object(answer)
    except ValueError:
        return 0
    usage = parsed.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def rewrite_cached_tokens(answer: bytes, value: int) -> bytes | None:
    """The decode answer with ``usage.prompt_tokens_details.cached_tokens`` set to ``value`` (the details made when
    absent, as llm-d does); None when it has no ``usage`` object or is not a JSON object (left as it is)."""
    try:
        parsed = parse_object(answer)
    except ValueError:
        return None
    usage = parsed.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        details["cached_tokens"] = value
    else:
        usage["prompt_tokens_details"] = {"cached_tokens": value}
    return orjson.dumps(parsed)
