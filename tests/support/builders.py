"""Builders the picker's tests share: a PickerApp from a config dict, a static pool of N backends, a request
stream and the ext_proc servicer on an app, and one chat request routed through an app's request path."""

from __future__ import annotations

import json
from typing import Any

from picker.config import parse_settings
from picker.extproc.service import ExternalProcessor
from picker.extproc.stream import RequestStream
from picker.facts import Answer, RequestFacts
from picker.kv.stage import KvLookup
from picker.ops.metrics import PickerMetrics
from picker.request.exchange import Exchange
from picker.request.path import Inbound
from picker.routing.endpoints import BackendHold
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app

CHAT = "/v1/chat/completions"
BACKENDS = [{"name": "a", "address": "10.0.0.1:8000"}, {"name": "b", "address": "10.0.0.2:8000"}]


def static_pool(n: int = 2, port: int = 8000) -> dict[str, Any]:
    """The ``pool`` section of ``n`` static backends a, b, c, ... at 10.0.0.1:``port``, 10.0.0.2:``port``, ..."""
    return {"backends": [{"name": chr(ord("a") + i), "address": f"10.0.0.{i + 1}:{port}"} for i in range(n)]}


def app_of(config: dict[str, Any], metrics: PickerMetrics | None = None) -> PickerApp:
    """The PickerApp ``kv-epp serve`` would build from ``config`` (the YAML as a dict), not started."""
    return build_app(parse_settings(config), metrics)


def stream_of(app: PickerApp) -> RequestStream:
    """The stream of one request on ``app``'s request path (no response sampling)."""
    return RequestStream(app.path, app.metrics.route_seconds)


def processor_of(app: PickerApp) -> ExternalProcessor:
    """The ext_proc servicer over ``app``'s collaborators."""
    return ExternalProcessor(app.path, app.metrics, app.settings.extproc, app.sampling)


async def route(
    app: PickerApp, data: dict[str, Any], headers: dict[str, str] | None = None, path: str = CHAT
) -> Exchange | Answer:
    """One POST of ``data`` (as JSON) to ``path`` through ``app``'s request path: the exchange or the answer."""
    return await app.path.route(Inbound(path, {":method": "POST", **(headers or {})}, json.dumps(data).encode()))


class FixedHolds:
    """Tier 4's answer as the KV index hands it: backend → hold, with the prompt's token count (a request path's
    ``holds``)."""

    def __init__(self, holds: dict[str, BackendHold], prompt_tokens: int) -> None:
        self.holds, self.prompt_tokens = holds, prompt_tokens

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        return KvLookup(dict(self.holds), self.prompt_tokens)

    def page_tokens(self, backend: str) -> int | None:
        return None
