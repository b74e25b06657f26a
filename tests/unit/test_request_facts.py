import pytest

from picker.request.facts import BadRequest, api_for_path, parse_request


def parse(body: bytes, path: str = "/v1/chat/completions", limit: int = 1 << 20):
    return parse_request(body, path, max_body_bytes=limit, session_id="s", tenant_id="t")


def test_api_for_path() -> None:
    assert api_for_path("/v1/chat/completions?x=1") == "chat"
    assert api_for_path("/v1/completions") == "completions"
    assert api_for_path("/v1/messages") == "anthropic"
    assert api_for_path("/anthropic/v1/messages") == "anthropic"
    assert api_for_path("/v1/models") == "other"


def test_chat_facts() -> None:
    f = parse(
        b'{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"U"}],'
        b'"stream":true,"stream_options":{"include_usage":true},"temperature":0,"max_tokens":5,"top_p":0.5}'
    )
    assert (f.model, f.system, f.first_message, f.stream, f.include_usage) == ("m", "S", "U", True, True)
    assert (f.temperature, f.max_tokens, f.top_p, f.session_id, f.tenant_id) == (0.0, 5, 0.5, "s", "t")
    assert f.messages is not None and len(f.messages) == 2


def test_developer_role_counts_as_system() -> None:
    f = parse(b'{"model":"m","messages":[{"role":"developer","content":"D"},{"role":"user","content":"U"}]}')
    assert f.system == "D"


def test_anthropic_facts() -> None:
    f = parse(
        b'{"model":"c","max_tokens":3,"system":[{"type":"text","text":"A"},{"type":"text","text":"B"}],'
        b'"messages":[{"role":"user","content":"hi"}]}',
        "/v1/messages",
    )
    assert (f.api, f.system, f.first_message) == ("anthropic", "A\nB", "hi")


def test_completions_facts() -> None:
    f = parse(b'{"model":"m","prompt":"P"}', "/v1/completions")
    assert (f.api, f.prompt, f.first_message) == ("completions", "P", "P")


@pytest.mark.parametrize(
    ("body", "path", "code"),
    [
        (b"", "/v1/chat/completions", "invalid_json"),
        (b"{", "/v1/chat/completions", "invalid_json"),
        (b'"str"', "/v1/chat/completions", "invalid_type"),
        (b'{"messages":[]}', "/v1/chat/completions", "missing_model"),
        (b'{"model":""}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m"}', "/v1/chat/completions", "missing_messages"),
        (b'{"model":"m","messages":{}}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m","messages":[1]}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m","messages":[{"content":"x"}]}', "/v1/chat/completions", "invalid_type"),
        (
            b'{"model":"m","messages":[{"role":"user","content":[{"text":1}]}]}',
            "/v1/chat/completions",
            "invalid_type",
        ),
        (b'{"model":"m","messages":[{"role":"user","content":[7]}]}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m","messages":[],"temperature":"hot"}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m","messages":[],"max_tokens":1.5}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m","messages":[],"stream_options":3}', "/v1/chat/completions", "invalid_type"),
        (b'{"model":"m"}', "/v1/completions", "missing_prompt"),
        (b'{"model":"m","prompt":[1,2,3]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","system":5,"messages":[]}', "/v1/messages", "invalid_type"),
    ],
)
def test_bad_requests_name_the_problem(body: bytes, path: str, code: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse(body, path)
    assert exc.value.code == code
    assert b'"message"' in exc.value.json_body()


def test_body_limit() -> None:
    with pytest.raises(BadRequest) as exc:
        parse(b'{"model":"m","messages":[]}', limit=10)
    assert exc.value.code == "body_too_large"


def test_other_paths_without_body_are_fine() -> None:
    f = parse(b"", "/v1/models")
    assert f.api == "other" and f.model is None


def test_other_paths_with_non_json_bodies_are_routed() -> None:
    f = parse(b"--boundary\r\nContent-Disposition: form-data; name=file\r\n\r\nRIFF....", "/v1/audio/transcriptions")
    assert f.api == "other" and f.model is None
    assert parse(b"[1, 2]", "/v1/rerank").api == "other"


def test_deeply_nested_json_is_a_clean_error() -> None:
    with pytest.raises(BadRequest):
        parse(b"[" * 100_000 + b"]" * 100_000)
