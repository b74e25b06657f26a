"""Where a request for a gemini model goes and what it carries: the OpenAI-compatible endpoint or the native API,
the context cache's reference on a hit, the key and the client's credentials, and the response converter (JSON
whole at the end, SSE event by event, an error passed as sent). No I/O: the context cache is a stub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from picker.config import GeminiBackendConfig, parse_settings
from picker.facts import parse_request_body
from picker.gemini import route as rt
from picker.gemini.context_cache import Lookup
from picker.gemini.route import ApiKeys, GeminiRouter, ResponseConverter, compat_path

MODEL = "gemini-2.5-flash"
CHAT = "/v1/chat/completions"
KEY = "k" * 39


class StubCache:
    """The context cache's lookup, answering what the test says."""

    def __init__(self, answer: Lookup) -> None:
        self.answer = answer
        self.seen: list[tuple[str, str, str | None]] = []

    def lookup(self, backend: GeminiBackendConfig, model: str, system: str | None) -> Lookup:
        self.seen.append((backend.name, model, system))
        return self.answer


def router(tmp_path: Path, *, native: bool, answer: Lookup | None = None, key: str | None = KEY) -> GeminiRouter:
    key_file = tmp_path / "key"
    if key is not None:
        key_file.write_text(key + "\n")
    s = parse_settings({
        "pool": {"backends": [{"name": "g", "type": "gemini", "api_key_file": str(key_file), "models": [MODEL]}]},
        "gemini_context_cache": {"prefer_native_api": native},
    })  # fmt: skip
    return GeminiRouter(s, StubCache(answer) if answer is not None else None)  # type: ignore[arg-type]


def chat(**kw: Any) -> tuple[Any, dict[str, Any], bytes]:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "S" * 100}, {"role": "user", "content": "hi"}],
            "max_tokens": 5, **kw}  # fmt: skip
    raw = orjson.dumps(body)
    facts, data = parse_request_body(raw, "/v1/chat/completions", max_body_bytes=1 << 20)
    assert data is not None
    return facts, data, raw


def go(
    r: GeminiRouter, facts: Any, data: dict[str, Any] | None, path: str = "/v1/chat/completions"
) -> rt.ExternalRoute:
    backend = r.backend_for(facts.model)
    assert backend is not None
    route = r.route(facts, backend, path, data)
    assert route is not None
    return route


def test_a_gemini_model_finds_its_backend_and_others_do_not(tmp_path: Path) -> None:
    r = router(tmp_path, native=False)
    assert r.backend_for(MODEL) is not None
    assert r.backend_for("llama") is None and r.backend_for(None) is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/v1/chat/completions", "/v1beta/openai/chat/completions"), ("/v1/embeddings", "/v1beta/openai/embeddings"),
     ("/v1/responses?x=1", "/v1beta/openai/responses?x=1"), ("/chat/completions", "/v1beta/openai/chat/completions")],
)  # fmt: skip
def test_the_openai_paths_map_onto_googles_compatible_api(path: str, expected: str) -> None:
    assert compat_path(path) == expected


def test_the_compatible_endpoint_gets_the_body_as_sent_the_key_and_not_the_clients_credentials(tmp_path: Path) -> None:
    facts, data, _ = chat()
    route = go(router(tmp_path, native=False), facts, data)
    assert route.api == "openai" and route.path == "/v1beta/openai/chat/completions"
    assert route.body is None and route.converter is None  # unchanged, answered in the OpenAI shape already
    assert ("x-goog-api-key", KEY) in route.set_headers and ("authorization", f"Bearer {KEY}") in route.set_headers
    assert "x-api-key" in route.remove_headers


def test_a_hit_on_the_compatible_endpoint_references_the_resource_without_the_system_text(tmp_path: Path) -> None:
    facts, data, _ = chat()
    route = go(router(tmp_path, native=False, answer=Lookup("hit", "cachedContents/abc")), facts, data)
    assert route.body is not None
    sent = orjson.loads(route.body)
    assert sent["extra_body"]["google"]["cached_content"] == "cachedContents/abc"
    assert [m["role"] for m in sent["messages"]] == ["user"]


def test_the_native_api_gets_a_converted_body_and_a_converter_and_a_hit_drops_the_system_instruction(
    tmp_path: Path,
) -> None:
    facts, data, _ = chat(stream=True)
    stub_hit = Lookup("hit", "cachedContents/abc")
    route = go(router(tmp_path, native=True, answer=stub_hit), facts, data)
    assert route.api == "native" and route.path == f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
    assert route.body is not None
    sent = orjson.loads(route.body)
    assert sent["cachedContent"] == "cachedContents/abc" and "systemInstruction" not in sent
    assert route.converter is not None and route.converter.stream and route.cache is stub_hit
    assert ("authorization", f"Bearer {KEY}") not in route.set_headers  # the native API takes x-goog-api-key
    miss = go(router(tmp_path, native=True, answer=Lookup("miss")), *chat()[:2])
    assert miss.body is not None and "systemInstruction" in orjson.loads(miss.body)  # a miss goes as sent


def test_what_the_native_api_cannot_carry_goes_to_the_compatible_endpoint_unchanged(tmp_path: Path) -> None:
    facts, data, _ = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    route = go(router(tmp_path, native=True), facts, data)
    assert route.api == "openai" and route.body is None and route.converter is None


def test_other_apis_pass_through_and_the_cache_is_not_consulted(tmp_path: Path) -> None:
    raw = orjson.dumps({"model": MODEL, "input": "embed me"})
    facts, data = parse_request_body(raw, "/v1/embeddings", max_body_bytes=1 << 20)
    r = router(tmp_path, native=True, answer=Lookup("hit", "cachedContents/x"))
    route = go(r, facts, data, "/v1/embeddings")
    assert route.api == "passthrough" and route.path == "/v1beta/openai/embeddings" and route.body is None
    assert r.cache.seen == []  # type: ignore[union-attr]


def test_an_unreadable_key_file_leaves_no_key_and_says_why_without_a_key(tmp_path: Path) -> None:
    r = router(tmp_path, native=False, key=None)
    backend = r.backend_for(MODEL)
    assert backend is not None and r.keys.key(backend) is None
    why = r.keys.error(backend)
    assert why is not None and str(tmp_path / "key") in why
    (tmp_path / "key").write_text(KEY)
    r.refresh_keys()  # a rotated (here: created) Secret is read again
    assert r.keys.key(backend) == KEY and r.keys.error(backend) is None


def test_api_keys_read_each_file_once_per_load(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_text(" abc \n")
    b = GeminiBackendConfig(name="a", type="gemini", api_key_file=str(f), models=("m",))
    keys = ApiKeys()
    keys.load((b, b.model_copy(update={"name": "b"})))
    assert keys.key(b) == "abc"


NATIVE_JSON = {
    "candidates": [{"content": {"parts": [{"text": "hello"}], "role": "model"}, "finishReason": "STOP"}],
    "usageMetadata": {"promptTokenCount": 5000, "cachedContentTokenCount": 4900, "candidatesTokenCount": 1},
}


def test_a_json_answer_is_converted_whole_at_its_end() -> None:
    c = ResponseConverter(MODEL, stream=False, include_usage=False)
    assert c.start(200) and c.content_type == "application/json"
    raw = orjson.dumps(NATIVE_JSON)
    assert c.feed(raw[:10], False) == b""
    doc = orjson.loads(c.feed(raw[10:], True))
    assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"] == "hello"
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 4900
    assert c.usage is not None and c.usage.cached == 4900


def test_a_stream_is_converted_event_by_event_with_the_usage_chunk() -> None:
    c = ResponseConverter(MODEL, stream=True, include_usage=True)
    assert c.start(200) and c.content_type == "text/event-stream"
    event = b"data: " + orjson.dumps(NATIVE_JSON) + b"\r\n\r\n"
    out = c.feed(event[:7], False) + c.feed(event[7:], True)
    assert out.endswith(b"data: [DONE]\n\n") and b'"cached_tokens":4900' in out
    assert c.usage is not None and c.usage.cached == 4900


def test_an_error_answer_passes_as_sent_and_an_unparseable_one_too() -> None:
    c = ResponseConverter(MODEL, stream=False, include_usage=False)
    assert not c.start(429)
    assert c.feed(b'{"error": {"code": 429}}', True) == b'{"error": {"code": 429}}'
    ok = ResponseConverter(MODEL, stream=False, include_usage=False)
    ok.start(200)
    assert ok.feed(b"not json", True) == b"not json"


def test_a_json_answer_too_large_to_hold_passes_unconverted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "MAX_JSON_RESPONSE_BYTES", 16)
    c = ResponseConverter(MODEL, stream=False, include_usage=False)
    c.start(200)
    assert c.feed(b"0123456789", False) == b""
    assert c.feed(b"abcdefghij", False) == b"0123456789abcdefghij"  # what was held, and then as it comes
    assert c.feed(b"tail", True) == b"tail"


def test_a_request_with_tools_does_not_consult_the_cache(tmp_path: Path) -> None:
    r = router(tmp_path, native=False, answer=Lookup("hit", "cachedContents/abc"))
    facts, data, _ = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    route = go(r, facts, data)
    assert route.body is None and route.cache.result == "disabled" and r.cache.seen == []  # type: ignore[union-attr]


def test_without_readable_answers_the_native_api_is_not_used(tmp_path: Path) -> None:
    facts, data, _ = chat()
    r = router(tmp_path, native=True)
    backend = r.backend_for(MODEL)
    assert backend is not None
    route = r.route(facts, backend, CHAT, data, responses_readable=False)
    assert route is not None and route.api == "openai" and route.converter is None
    native = go(r, facts, data)
    assert native.api == "native" and "accept-encoding" in native.remove_headers  # the converter reads it plain


def test_a_system_message_with_non_text_parts_passes_unchanged(tmp_path: Path) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    facts, data, _ = chat(messages=[{"role": "system", "content": [image]}, {"role": "user", "content": "hi"}])
    r = router(tmp_path, native=True, answer=Lookup("miss"))
    route = go(r, facts, data)
    assert route.api == "openai" and route.body is None
    assert r.cache.seen == [("g", MODEL, None)]  # type: ignore[union-attr]


def test_the_clients_key_parameter_never_reaches_google() -> None:
    assert compat_path("/v1/models?key=CLIENT&page=2") == "/v1beta/openai/models?page=2"
    assert compat_path("/v1/models?key=CLIENT") == "/v1beta/openai/models"
