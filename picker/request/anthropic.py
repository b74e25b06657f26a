"""Anthropic ``cache_control`` injection (the seed's ``prefix_routing.anthropic_cache_control_injection``): pure,
bounded functions that mark a native Anthropic request's last system block, or leave the body unchanged.
See docs/picker.md, "Anthropic cache_control injection".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from picker.facts import api_for_path

CACHE_CONTROL_KEY = "cache_control"
EPHEMERAL: dict[str, str] = {"type": "ephemeral"}
DEFAULT_MAX_BODY_BYTES = 8 << 20  # the picker's own default request-body bound; callers pass theirs
_MAX_INT_AS_FLOAT = float(1 << 63)  # orjson reads an integer literal beyond 64 bits as a (lossy) float


def is_native_anthropic(path: str) -> bool:
    """Whether a request to ``path`` (query string ignored) is a native Anthropic Messages request."""
    return api_for_path(path) == "anthropic"


def injection_wanted(flag: bool, backend_auto_cache_control: bool | None = None) -> bool:
    """The seed's precedence: the fleet-wide ``anthropic_cache_control_injection: true`` forces injection;
    otherwise a backend's own ``anthropic_auto_cache_control`` decides (unset = true for a native Anthropic
    backend). The picker's endpoints are inference engines, not Anthropic's API, and carry no such setting:
    they pass ``None`` and the flag alone decides."""
    if flag:
        return True
    return bool(backend_auto_cache_control)


def _walk_unsafe(root: Any) -> bool:
    """True when ``root`` holds a ``cache_control`` key at any depth, or an integral float too large for a
    64-bit integer (a big integer literal orjson could not keep). Iterative: no recursion limit to hit."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if CACHE_CONTROL_KEY in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, float) and abs(node) >= _MAX_INT_AS_FLOAT and node.is_integer():
            return True
    return False


def _marked_system(system: Any) -> list[Any] | None:
    """The new ``system`` value with the marker on its last block, or None when there is nothing to mark."""
    if isinstance(system, str):
        if not system:
            return None
        return [{"type": "text", "text": system, CACHE_CONTROL_KEY: dict(EPHEMERAL)}]
    if not isinstance(system, list) or not system:
        return None
    last = system[-1]
    if not isinstance(last, dict) or not isinstance(last.get("type"), str):
        return None
    if last["type"] == "text" and not last.get("text"):
        return None  # Anthropic refuses cache_control on an empty text block
    blocks = list(system)
    blocks[-1] = {**last, CACHE_CONTROL_KEY: dict(EPHEMERAL)}
    return blocks


def inject_cache_control(body: bytes, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes | None:
    """The body with ``cache_control: {"type": "ephemeral"}`` on its last system block, or None to forward
    ``body`` unchanged (already marked, no system prompt, too large, not a JSON object, malformed)."""
    if not body or len(body) > max_body_bytes:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or "system" not in data:
        return None
    marked = _marked_system(data["system"])
    if marked is None or _walk_unsafe(data):
        return None
    data["system"] = marked
    try:
        return orjson.dumps(data)
    except (TypeError, orjson.JSONEncodeError):  # cannot happen for parsed JSON; never raise on the path
        return None


def count_markers(body: bytes | Mapping[str, Any]) -> int:
    """How many ``cache_control`` keys a request carries (tests and diagnostics)."""
    root: Any = orjson.loads(body) if isinstance(body, bytes) else body
    n = 0
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            n += CACHE_CONTROL_KEY in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return n
