"""picker.gemini.convert, pure: the system text, OpenAI chat → generateContent (and what is refused), the cache's
create body, the OpenAI-compatible body with a cache reference, the native paths, usage, the response and the
stream converter (CRLF and LF events split anywhere, a UTF-8 character split across chunks, error events, the
8 MiB bound)."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.gemini.convert import (
    MAX_CHOICES,
    MAX_STREAM_EVENT_BYTES,
    ConversionError,
    NativeUsage,
    StreamConverter,
    cache_create_body,
    finish_reason,
    from_native_response,
    native_path,
    native_usage,
    openai_compat_with_cache,
    openai_usage,
    system_text,
    to_native_request,
)

SYSTEM = "You are a careful assistant."
CACHE = "cachedContents/abc123"


def chat(*messages: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "gemini-2.5-flash", "messages": list(messages), **fields}


def msg(role: str | None, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


# ---- system_text ----------------------------------------------------------------------------------------------


def test_system_text_joins_the_system_and_developer_messages_wherever_they_stand() -> None:
    body = chat(msg("system", "one"), msg("user", "hi"), msg("developer", "two"), msg("assistant", "ok"))
    assert system_text(body) == "one\ntwo"


def test_system_text_takes_the_text_parts_of_a_list_content() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert system_text(chat(msg("system", parts), msg("user", "hi"))) == "ab"


def test_system_text_is_none_without_a_system_message_or_text() -> None:
    assert system_text(chat(msg("user", "hi"))) is None
    assert system_text(chat(msg("system", ""), msg("user", "hi"))) is None
    assert system_text(chat(msg("system", None), msg("user", "hi"))) is None


@pytest.mark.parametrize(
    "body",
    [
        [],
        "text",
        {"model": "m"},
        {"messages": "hi"},
        chat(msg("system", [{"type": "image_url", "image_url": {"url": "x"}}])),
        chat(msg("system", [{"type": "text", "text": 3}])),
        chat(msg("system", ["bare string part"])),
        chat(msg("system", 42)),
    ],
)
def test_system_text_refuses_what_it_cannot_read(body: Any) -> None:
    with pytest.raises(ConversionError):
        system_text(body)


# ---- to_native_request ----------------------------------------------------------------------------------------


def test_a_conversation_becomes_contents_with_the_system_instruction() -> None:
    body = chat(msg("system", SYSTEM), msg("user", "hi"), msg("assistant", "hello"), msg("user", "more"))
    assert to_native_request(body) == {
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "contents": [
            {"role": "user", "parts": [{"text": "hi"}]},
            {"role": "model", "parts": [{"text": "hello"}]},
            {"role": "user", "parts": [{"text": "more"}]},
        ],
    }


def test_with_a_cached_content_the_system_instruction_is_left_out_and_the_resource_named() -> None:
    native = to_native_request(chat(msg("system", SYSTEM), msg("user", "hi")), cached_content=CACHE)
    assert native == {"cachedContent": CACHE, "contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


def test_text_parts_become_one_text_part() -> None:
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    assert to_native_request(chat(msg("user", parts)))["contents"] == [{"role": "user", "parts": [{"text": "a b"}]}]


def test_the_sampling_parameters_become_the_generation_config() -> None:
    body = chat(
        msg("user", "hi"),
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        max_tokens=100,
        stop=["END", "STOP"],
        n=2,
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        response_format={"type": "json_object"},
    )
    assert to_native_request(body)["generationConfig"] == {
        "temperature": 0.5,
        "topP": 0.9,
        "topK": 40,
        "maxOutputTokens": 100,
        "stopSequences": ["END", "STOP"],
        "candidateCount": 2,
        "seed": 7,
        "presencePenalty": 0.1,
        "frequencyPenalty": -0.2,
        "responseMimeType": "application/json",
    }


def test_max_completion_tokens_supersedes_max_tokens_and_a_stop_string_is_a_list() -> None:
    cfg = to_native_request(chat(msg("user", "hi"), max_tokens=5, max_completion_tokens=9, stop="END"))
    assert cfg["generationConfig"] == {"maxOutputTokens": 9, "stopSequences": ["END"]}


def test_nulls_and_a_text_response_format_add_nothing() -> None:
    body = chat(msg("user", "hi"), temperature=None, stop=None, max_tokens=None, response_format={"type": "text"})
    assert "generationConfig" not in to_native_request(body)
    assert "generationConfig" not in to_native_request(chat(msg("user", "hi"), stop=[]))


def test_transport_and_bookkeeping_keys_are_dropped_not_copied() -> None:
    body = chat(
        msg("user", "hi"),
        stream=True,
        stream_options={"include_usage": True},
        user="u1",
        metadata={"a": "b"},
        store=False,
        tool_choice="none",
        function_call="none",
        tools=[],
        unknown_key=1,
    )
    assert set(to_native_request(body)) == {"contents"}


def test_the_input_is_not_modified() -> None:
    body = chat(msg("system", SYSTEM), msg("user", [{"type": "text", "text": "hi"}]), temperature=1, stop="x")
    before = copy.deepcopy(body)
    to_native_request(body)
    to_native_request(body, cached_content=CACHE)
    openai_compat_with_cache(body, CACHE)
    assert body == before


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (chat(msg("user", "hi"), msg("tool", "42", tool_call_id="c1")), "role 'tool'"),
        (chat(msg("user", "hi"), msg("function", "42", name="f")), "role 'function'"),
        (chat(msg("user", "hi"), msg("assistant", None, tool_calls=[{"id": "c1"}])), "tool calls"),
        (chat(msg("user", [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])), "'image_url' part"),
        (chat(msg("user", [{"type": "input_audio", "input_audio": {}}])), "'input_audio' part"),
        (chat(msg("user", "hi"), tools=[{"type": "function", "function": {"name": "f"}}]), "'tools'"),
        (chat(msg("user", "hi"), tool_choice="required"), "'tool_choice'"),
        (chat(msg("user", "hi"), logprobs=True), "logprobs"),
        (chat(msg("user", "hi"), logit_bias={"1": 5}), "logit_bias"),
        (chat(msg("user", "hi"), modalities=["text", "audio"]), "modalities"),
        (chat(msg("user", "hi"), response_format={"type": "json_schema", "json_schema": {}}), "json_schema"),
        (chat(msg("user", "hi"), response_format="json"), "response_format"),
        (chat(msg("user", "")), "no text"),
        (chat(msg("user", None)), "no text"),
        (chat(msg("system", SYSTEM)), "no user or assistant"),
        (chat(), "no user or assistant"),
        (chat("hi"), "must be an object"),
        (chat(msg(None, "hi")), "role None"),
        (chat(msg("user", "hi"), temperature="hot"), "'temperature' must be a number"),
        (chat(msg("user", "hi"), temperature=math.inf), "finite"),
        (chat(msg("user", "hi"), n=True), "'n' must be an integer"),
        (chat(msg("user", "hi"), max_tokens=1.5), "'max_tokens' must be an integer"),
        (chat(msg("user", "hi"), stop=["a", 1]), "'stop'"),
        ({"messages": None}, "'messages'"),
        (["not", "an", "object"], "JSON object"),
    ],
)
def test_what_is_not_converted_raises_a_conversion_error_that_says_why(body: Any, says: str) -> None:
    with pytest.raises(ConversionError, match=None) as e:
        to_native_request(body)
    assert says in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", ["", "abc", "cachedContents/", 5])
def test_a_bad_cached_content_name_is_refused(name: Any) -> None:
    with pytest.raises(ConversionError, match="cachedContents/ID"):
        to_native_request(chat(msg("user", "hi")), cached_content=name)


# ---- cache_create_body ----------------------------------------------------------------------------------------


def test_the_create_body_names_the_model_holds_the_system_prompt_and_a_whole_second_ttl() -> None:
    assert cache_create_body("gemini-2.5-flash", SYSTEM, 600.9) == {
        "model": "models/gemini-2.5-flash",
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "ttl": "600s",
    }


@pytest.mark.parametrize(
    ("model", "system", "ttl"),
    [
        ("models/gemini", SYSTEM, 60),
        ("gemini?x", SYSTEM, 60),
        ("", SYSTEM, 60),
        ("gemini", "", 60),
        ("gemini", None, 60),
        ("gemini", SYSTEM, 0.5),
        ("gemini", SYSTEM, math.nan),
        ("gemini", SYSTEM, True),
        ("gemini", SYSTEM, "60s"),
    ],
)
def test_a_create_body_refuses_a_bad_model_system_or_ttl(model: Any, system: Any, ttl: Any) -> None:
    with pytest.raises(ConversionError):
        cache_create_body(model, system, ttl)


# ---- openai_compat_with_cache ---------------------------------------------------------------------------------


def test_the_compat_body_drops_the_system_messages_and_references_the_cache() -> None:
    body = chat(msg("system", SYSTEM), msg("developer", "d"), msg("user", "hi"), stream=True)
    assert openai_compat_with_cache(body, CACHE) == {
        "model": "gemini-2.5-flash",
        "messages": [msg("user", "hi")],
        "stream": True,
        "extra_body": {"google": {"cached_content": CACHE}},
    }


def test_the_compat_body_merges_an_existing_extra_body() -> None:
    extra = {"google": {"thinking_config": {"thinking_budget": 0}, "cached_content": "cachedContents/old"}, "x": 1}
    out = openai_compat_with_cache(chat(msg("user", "hi"), extra_body=extra), CACHE)
    assert out["extra_body"] == {"google": {"thinking_config": {"thinking_budget": 0}, "cached_content": CACHE}, "x": 1}


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (chat(msg("user", "hi"), extra_body="x"), CACHE),
        (chat(msg("user", "hi"), extra_body={"google": ["x"]}), CACHE),
        (chat(msg("user", "hi")), "abc"),
        ({"messages": 1}, CACHE),
    ],
)
def test_the_compat_body_refuses_odd_input(body: Any, name: Any) -> None:
    with pytest.raises(ConversionError):
        openai_compat_with_cache(body, name)


# ---- native_path ----------------------------------------------------------------------------------------------


def test_the_native_paths() -> None:
    assert native_path("gemini-2.5-flash", False) == "/v1beta/models/gemini-2.5-flash:generateContent"
    assert native_path("gemini-2.5-flash", True) == "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"


def test_a_model_is_percent_encoded() -> None:
    assert native_path("a b:c#d%e", False) == "/v1beta/models/a%20b%3Ac%23d%25e:generateContent"


@pytest.mark.parametrize("model", ["models/gemini", "../x", "a?alt=json", "", "x" * 257, None, 3])
def test_a_model_that_would_change_the_path_is_refused(model: Any) -> None:
    with pytest.raises(ConversionError):
        native_path(model, False)


# ---- native_usage, openai_usage, finish_reason ----------------------------------------------------------------


def test_native_usage_reads_every_count_and_adds_the_thoughts_to_the_completion() -> None:
    meta = {
        "promptTokenCount": 5000,
        "cachedContentTokenCount": 4096,
        "candidatesTokenCount": 20,
        "thoughtsTokenCount": 30,
        "totalTokenCount": 5050,
    }
    assert native_usage({"usageMetadata": meta}) == NativeUsage(prompt=5000, cached=4096, completion=50, total=5050)


def test_native_usage_is_none_where_a_count_is_absent_or_malformed() -> None:
    assert native_usage({}) == NativeUsage()
    assert native_usage({"usageMetadata": "x"}) == NativeUsage()
    assert native_usage([]) == NativeUsage()  # type: ignore[arg-type]
    meta = {
        "promptTokenCount": "5",
        "cachedContentTokenCount": True,
        "candidatesTokenCount": -1,
        "totalTokenCount": 1.5,
    }
    assert native_usage({"usageMetadata": meta}) == NativeUsage()
    assert native_usage({"usageMetadata": {"thoughtsTokenCount": 3}}).completion == 3


def test_openai_usage_keeps_the_cached_tokens_inside_the_prompt_tokens() -> None:
    assert openai_usage(NativeUsage(prompt=5000, cached=4096, completion=50, total=5050)) == {
        "prompt_tokens": 5000,
        "completion_tokens": 50,
        "total_tokens": 5050,
        "prompt_tokens_details": {"cached_tokens": 4096},
    }
    assert openai_usage(NativeUsage(prompt=10, completion=2)) == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    ("native", "openai"),
    [
        ("STOP", "stop"),
        ("MAX_TOKENS", "length"),
        ("SAFETY", "content_filter"),
        ("RECITATION", "content_filter"),
        ("BLOCKLIST", "content_filter"),
        ("PROHIBITED_CONTENT", "content_filter"),
        ("SPII", "content_filter"),
        ("OTHER", "stop"),
        ("FINISH_REASON_UNSPECIFIED", "stop"),
        (None, "stop"),
        (3, "stop"),
    ],
)
def test_finish_reasons(native: Any, openai: str) -> None:
    assert finish_reason(native) == openai


# ---- from_native_response -------------------------------------------------------------------------------------

USAGE = {"promptTokenCount": 5000, "cachedContentTokenCount": 4096, "candidatesTokenCount": 3, "totalTokenCount": 5003}


def native_response(*candidates: dict[str, Any], usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "candidates": list(candidates),
        "usageMetadata": usage or USAGE,
        "modelVersion": "gemini-2.5-flash",
        **extra,
    }


def candidate(*texts: str, reason: str = "STOP", **extra: Any) -> dict[str, Any]:
    return {"content": {"role": "model", "parts": [{"text": t} for t in texts]}, "finishReason": reason, **extra}


def test_a_response_becomes_a_chat_completion_with_the_cached_tokens_in_its_usage() -> None:
    out = from_native_response(native_response(candidate("Hel", "lo")), model="m", response_id="r1", created=7)
    assert out == {
        "id": "r1",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 5000,
            "completion_tokens": 3,
            "total_tokens": 5003,
            "prompt_tokens_details": {"cached_tokens": 4096},
        },
    }


def test_one_choice_per_candidate_in_index_order_and_thoughts_and_other_parts_left_out() -> None:
    second = candidate("b", reason="MAX_TOKENS", index=1)
    first = {
        "content": {"parts": [{"text": "thinking", "thought": True}, {"functionCall": {}}, {"text": "a"}]},
        "finishReason": "SAFETY",
        "index": 0,
    }
    out = from_native_response(native_response(second, first), model="m", response_id="r", created=0)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "a", "content_filter"),
        (1, "b", "length"),
    ]


def test_a_candidate_without_an_index_has_its_position() -> None:
    out = from_native_response(native_response(candidate("a"), candidate("b")), model="m", response_id="r", created=0)
    assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [(0, "a"), (1, "b")]


def test_a_blocked_prompt_is_one_empty_content_filter_choice() -> None:
    resp = {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9}}
    out = from_native_response(resp, model="m", response_id="r", created=0)
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": "content_filter",
        }
    ]
    assert out["usage"]["prompt_tokens"] == 9 and out["usage"]["completion_tokens"] == 0


def test_no_candidates_without_a_block_is_one_empty_stop_choice_and_odd_parts_are_no_text() -> None:
    out = from_native_response({"candidates": []}, model="m", response_id="r", created=0)
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["message"]["content"] == ""
    assert out["usage"] == openai_usage(NativeUsage())
    odd = {"candidates": [{"content": "x"}, 5, {"content": {"parts": [1, {"text": 2}]}}]}
    assert [
        c["message"]["content"] for c in from_native_response(odd, model="m", response_id="r", created=0)["choices"]
    ] == [
        "",
        "",
    ]


@pytest.mark.parametrize("resp", [[], "x", {"error": {"code": 400, "message": "bad", "status": "INVALID_ARGUMENT"}}])
def test_an_error_or_non_object_response_raises_a_conversion_error(resp: Any) -> None:
    with pytest.raises(ConversionError):
        from_native_response(resp, model="m", response_id="r", created=0)


# ---- StreamConverter ------------------------------------------------------------------------------------------


def event(obj: Any, end: bytes = b"\r\n\r\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + end


STREAM_EVENTS = [
    {"candidates": [{"content": {"role": "model", "parts": [{"text": "안녕 "}]}, "index": 0}],
     "usageMetadata": {"promptTokenCount": 5000, "totalTokenCount": 5000}},
    {"candidates": [{"content": {"role": "model", "parts": [{"text": "세계 😀"}]}, "index": 0}],
     "usageMetadata": {"promptTokenCount": 5000, "totalTokenCount": 5000}},
    {"candidates": [{"content": {"role": "model", "parts": [{"text": "!"}]}, "finishReason": "STOP", "index": 0}],
     "usageMetadata": USAGE},
]  # fmt: skip
CRLF_STREAM = b"".join(event(e) for e in STREAM_EVENTS)
LF_STREAM = b"".join(event(e, b"\n\n") for e in STREAM_EVENTS)


def converter(include_usage: bool = True) -> StreamConverter:
    return StreamConverter("gemini-2.5-flash", "chatcmpl-1", 1700000000, include_usage)


def convert(chunks: list[bytes], include_usage: bool = True) -> bytes:
    conv = converter(include_usage)
    return b"".join(conv.feed(c) for c in chunks) + conv.finish()


def events_of(out: bytes) -> list[Any]:
    """The data of each OpenAI event (every one is ``data: ...\\n\\n``)."""
    assert out.endswith(b"\n\n")
    frames = out[:-2].split(b"\n\n")
    assert all(f.startswith(b"data: ") for f in frames)
    return [f[6:].decode() if f == b"data: [DONE]" else orjson.loads(f[6:]) for f in frames]


def test_a_native_stream_becomes_openai_chunks_role_first_finish_last_then_usage_and_done() -> None:
    out = events_of(convert([CRLF_STREAM]))
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "gemini-2.5-flash"}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
            "usage": None,
        }

    assert out == [
        chunk({"role": "assistant", "content": "안녕 "}),
        chunk({"content": "세계 😀"}),
        chunk({"content": "!"}, "stop"),
        {
            **head,
            "choices": [],
            "usage": {
                "prompt_tokens": 5000,
                "completion_tokens": 3,
                "total_tokens": 5003,
                "prompt_tokens_details": {"cached_tokens": 4096},
            },
        },
        "[DONE]",
    ]


def test_without_include_usage_there_is_no_usage_chunk_nor_usage_field_but_the_usage_is_kept() -> None:
    conv = converter(include_usage=False)
    out = events_of(conv.feed(CRLF_STREAM) + conv.finish())
    assert out[-1] == "[DONE]" and len(out) == 4
    assert all("usage" not in e for e in out[:-1])
    assert conv.usage == NativeUsage(prompt=5000, cached=4096, completion=3, total=5003)


def test_crlf_and_lf_events_give_the_same_output() -> None:
    assert convert([CRLF_STREAM]) == convert([LF_STREAM])
    assert convert([CRLF_STREAM]) == convert([b"".join(event(e, b"\r\r") for e in STREAM_EVENTS)])


@pytest.mark.parametrize("stream", [CRLF_STREAM, LF_STREAM], ids=["crlf", "lf"])
def test_every_split_into_two_chunks_gives_the_same_output(stream: bytes) -> None:
    whole = convert([stream])
    for i in range(len(stream) + 1):
        assert convert([stream[:i], stream[i:]]) == whole, f"split at {i}"


def test_byte_by_byte_gives_the_same_output() -> None:
    assert convert([bytes([b]) for b in CRLF_STREAM]) == convert([CRLF_STREAM])


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(CRLF_STREAM)), max_size=12), lf=st.booleans())
def test_any_split_gives_the_same_output(cuts: list[int], lf: bool) -> None:
    stream = LF_STREAM if lf else CRLF_STREAM
    bounds = [0, *sorted(c for c in cuts if c <= len(stream)), len(stream)]
    assert convert([stream[a:b] for a, b in itertools.pairwise(bounds)]) == convert([stream])


def test_a_utf8_character_split_across_chunks_is_whole_in_the_output() -> None:
    stream = event({"candidates": [{"content": {"parts": [{"text": "😀"}]}, "finishReason": "STOP"}]})
    i = stream.index("😀".encode()) + 2  # inside the four bytes
    out = events_of(convert([stream[:i], stream[i:]]))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": "😀"}


def test_a_cr_at_a_chunk_end_waits_for_a_possible_lf() -> None:
    stream = event(STREAM_EVENTS[2])
    i = stream.index(b"\r")  # data line's CR ends chunk one; its LF starts chunk two
    conv = converter()
    assert conv.feed(stream[: i + 1]) == b""
    out = conv.feed(stream[i + 1 :])
    assert len(events_of(out)) == 1  # one event, not an extra blank line dispatching early or twice


def test_a_native_error_event_becomes_an_openai_error_event_and_the_stream_goes_on() -> None:
    error = {"error": {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED"}}
    out = events_of(convert([event(STREAM_EVENTS[0]) + event(error) + event(STREAM_EVENTS[2])]))
    assert out[1] == {"error": {"message": "Resource has been exhausted", "type": "RESOURCE_EXHAUSTED", "code": 429}}
    assert out[2]["choices"][0]["finish_reason"] == "stop"
    assert out[-1] == "[DONE]"


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_an_unparseable_event_becomes_an_error_event_and_the_stream_goes_on(data: bytes) -> None:
    out = events_of(convert([b"data: " + data + b"\r\n\r\n" + event(STREAM_EVENTS[2])]))
    assert out[0]["error"]["type"] == "upstream_protocol_error"
    assert out[1]["choices"][0]["delta"] == {"role": "assistant", "content": "!"}


def test_comments_other_fields_multiline_data_and_an_upstream_done_are_read_as_sse() -> None:
    body = orjson.dumps(STREAM_EVENTS[2]).decode()
    half = body.index(',"usageMetadata"')  # between two JSON tokens, where a line break is whitespace
    stream = (
        b": keep-alive\r\n\r\n"
        + b"event: message\r\nid: 1\r\nretry: 5\r\n"
        + f"data:{body[:half]}\r\ndata:{body[half:]}\r\n\r\n".encode()  # no space after the colon; JSON over lines
        + b"data: [DONE]\r\n\r\n"
    )
    out = events_of(convert([stream]))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": "!"}
    assert out[1:] == [out[1], "[DONE]"] and out[1]["choices"] == []


def test_a_last_event_without_its_blank_line_is_still_converted() -> None:
    out = events_of(convert([CRLF_STREAM[:-4]]))
    assert out[2]["choices"][0]["finish_reason"] == "stop"


def test_several_candidates_each_start_with_the_role() -> None:
    two = {"candidates": [candidate("a", index=0), candidate("b", index=1)]}
    out = events_of(convert([event(two)], include_usage=False))
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in out[:-1]] == [
        (0, {"role": "assistant", "content": "a"}),
        (1, {"role": "assistant", "content": "b"}),
    ]


def test_a_stream_tracks_a_bounded_number_of_candidates() -> None:
    many = {"candidates": [candidate("x", index=i) for i in range(MAX_CHOICES + 1)]}
    events = events_of(convert([event(many)], include_usage=False))
    assert len(events) == MAX_CHOICES + 2  # every tracked candidate, one error, [DONE]
    assert "candidates" in events[-2]["error"]["message"]


def test_a_blocked_prompt_in_a_stream_ends_with_content_filter() -> None:
    out = events_of(convert([event({"promptFeedback": {"blockReason": "SAFETY"}})], include_usage=False))
    assert out[0]["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": "content_filter",
    }


def test_an_event_with_nothing_new_adds_no_chunk_and_no_usage_seen_means_no_usage_chunk() -> None:
    empty = {"candidates": [{"content": {"parts": [{"text": ""}]}}]}
    out = events_of(convert([event(STREAM_EVENTS[0] | {"usageMetadata": None}) + event(empty)]))
    assert len(out) == 2 and out[-1] == "[DONE]"


def test_finish_is_idempotent_and_feed_after_it_is_refused() -> None:
    conv = converter()
    conv.feed(CRLF_STREAM)
    assert conv.finish().endswith(b"data: [DONE]\n\n")
    assert conv.finish() == b""
    with pytest.raises(ConversionError):
        conv.feed(b"data: {}\n\n")


def test_an_empty_stream_is_just_done() -> None:
    assert convert([]) == b"data: [DONE]\n\n"


def oversized_event(n: int = MAX_STREAM_EVENT_BYTES + 1) -> bytes:
    return b'data: {"x": "' + b"a" * n + b'"}\r\n\r\n'


@pytest.mark.parametrize("chunk_size", [1 << 20, 3 << 20, MAX_STREAM_EVENT_BYTES + 100])
def test_an_event_over_8_mib_is_dropped_with_an_error_and_the_buffer_stays_bounded(chunk_size: int) -> None:
    stream = event(STREAM_EVENTS[0]) + oversized_event() + event(STREAM_EVENTS[2])
    conv = converter()
    out = b""
    most = 0
    for i in range(0, len(stream), chunk_size):
        out += conv.feed(stream[i : i + chunk_size])
        most = max(most, conv.buffered)
    out += conv.finish()
    assert most <= MAX_STREAM_EVENT_BYTES
    events = events_of(out)
    assert [e.get("error", {}).get("type") for e in events[:-1] if isinstance(e, dict)].count("upstream_error") == 1
    assert "exceeds" in events[1]["error"]["message"]
    texts = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e.get("choices")]
    assert texts == ["안녕 ", "!"]  # the events before and after it are whole
    assert events[-1] == "[DONE]"


def test_an_event_of_many_data_lines_over_8_mib_is_dropped_too() -> None:
    line = b"data: " + b"a" * (1 << 20) + b"\n"
    stream = line * 9 + b"\n" + event(STREAM_EVENTS[2], b"\n\n")
    conv = converter()
    out = conv.feed(stream) + conv.finish()
    events = events_of(out)
    assert "exceeds" in events[0]["error"]["message"]
    assert events[1]["choices"][0]["delta"] == {"role": "assistant", "content": "!"}


def test_a_dropped_event_ends_at_its_blank_line_even_when_a_crlf_is_split() -> None:
    big = oversized_event()
    stream = big + event(STREAM_EVENTS[2])
    cut = len(big) - 3  # between the data line's CR and LF: b"\r" | b"\n\r\n"
    for chunks in ([stream[:cut], stream[cut:]], [stream[: cut - 1], stream[cut - 1 : cut + 1], stream[cut + 1 :]]):
        events = events_of(convert(chunks))
        assert "exceeds" in events[0]["error"]["message"]
        assert events[1]["choices"][0]["delta"] == {"role": "assistant", "content": "!"}


def test_an_event_just_under_the_bound_is_converted() -> None:
    text = "a" * (MAX_STREAM_EVENT_BYTES - 200)
    stream = event({"candidates": [{"content": {"parts": [{"text": text}]}, "finishReason": "STOP"}]})
    assert len(stream) < MAX_STREAM_EVENT_BYTES
    events = events_of(convert([stream[i : i + (1 << 20)] for i in range(0, len(stream), 1 << 20)]))
    assert events[0]["choices"][0]["delta"]["content"] == text
