"""The exchange of a request routed to a gemini backend: no lease; the converter starts on a 2xx answer only; the
body the observers see is the converted one's business of the stream; its end records the cached tokens."""

from __future__ import annotations

from typing import Any

import orjson

from picker.config import GeminiBackendConfig
from picker.facts import RequestFacts
from picker.gemini.context_cache import DISABLED
from picker.gemini.route import ExternalRoute, ResponseConverter
from picker.request.external import ExternalExchange

BACKEND = GeminiBackendConfig(name="g", type="gemini", api_key_file="/k", models=("m",))


class UsageSink:
    def __init__(self) -> None:
        self.got: list[tuple[str, int]] = []

    def record_usage(self, backend_name: str, cached_tokens: int) -> None:
        self.got.append((backend_name, cached_tokens))


class Seen:
    wants_body = True

    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_headers(self, ex: Any, status: int | None) -> None:
        self.events.append(("headers", status))

    def on_body(self, ex: Any, chunk: bytes, end: bool) -> None:
        self.events.append(("body", chunk, end))

    def on_end(self, ex: Any, completed: bool) -> None:
        self.events.append(("end", completed))


def exchange(conv: ResponseConverter | None, sink: UsageSink, seen: Seen) -> ExternalExchange:
    route = ExternalRoute(BACKEND, "external_g", "/p", (), (), None, conv, DISABLED, "native")
    return ExternalExchange(RequestFacts(api="chat", model="m"), route, (seen,), sink)  # type: ignore[arg-type]


def test_a_converted_answer_records_its_cached_tokens_once_at_the_end() -> None:
    sink, seen = UsageSink(), Seen()
    ex = exchange(ResponseConverter("m", stream=False, include_usage=False), sink, seen)
    ex.response_headers(200)
    native = {"candidates": [{"content": {"parts": [{"text": "x"}]}}], "usageMetadata": {"cachedContentTokenCount": 7}}
    body = ex.convert(orjson.dumps(native), True)
    ex.response_body(body, True)
    ex.end(completed=True)  # a second end (the stream's close) does nothing
    assert sink.got == [("g", 7)]
    assert seen.events[0] == ("headers", 200) and seen.events[-1] == ("end", True)
    assert orjson.loads(seen.events[1][1])["object"] == "chat.completion"


def test_an_error_answer_is_not_converted_and_records_nothing() -> None:
    sink, seen = UsageSink(), Seen()
    ex = exchange(ResponseConverter("m", stream=False, include_usage=False), sink, seen)
    ex.response_headers(503)
    assert ex.convert(b'{"error": {}}', True) == b'{"error": {}}'
    ex.end(completed=True)
    assert sink.got == []


def test_a_passthrough_exchange_hands_the_body_on_as_it_came() -> None:
    sink, seen = UsageSink(), Seen()
    ex = exchange(None, sink, seen)
    ex.response_headers(200)
    assert ex.convert(b"abc", False) == b"abc"
    ex.end(completed=False)
    assert seen.events[-1] == ("end", False) and sink.got == []


class ForgettingSink(UsageSink):
    def __init__(self) -> None:
        super().__init__()
        self.forgot: list[tuple[str, str]] = []

    def forget(self, backend_name: str, name: str) -> bool:
        self.forgot.append((backend_name, name))
        return True


def test_a_refused_reference_is_forgotten_and_a_served_one_is_not() -> None:
    from picker.gemini.context_cache import Lookup

    for status, forgotten in ((403, [("g", "cachedContents/x")]), (200, [])):
        sink = ForgettingSink()
        route = ExternalRoute(
            BACKEND, "external_g", "/p", (), (), None, None, Lookup("hit", "cachedContents/x"), "openai"
        )
        ex = ExternalExchange(RequestFacts(api="chat", model="m"), route, (), sink)  # type: ignore[arg-type]
        ex.response_headers(status)
        assert sink.forgot == forgotten
