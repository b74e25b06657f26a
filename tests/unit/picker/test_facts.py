import pytest

from picker.facts import BadRequest, api_for_path, parse_request


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
        (b'{"model":"m","prompt":[1,"a"]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":[1,-2]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":[1,true]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":[4294967296]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":["a",[1]]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":[[1],"a"]}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":[[]]}', "/v1/completions", "invalid_value"),
        (b'{"model":"m","prompt":[]}', "/v1/completions", "invalid_value"),
        (b'{"model":"m","prompt":{"id":"p"}}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","prompt":"p","max_tokens":4.5}', "/v1/completions", "invalid_type"),
        (b'{"model":"m","input":"x","prompt":{"id":3}}', "/v1/responses", "invalid_type"),
        (b'{"model":"m","input":5}', "/v1/responses", "invalid_type"),
        (b'{"model":"m","input":[3]}', "/v1/responses", "invalid_type"),
        (b'{"model":"m","input":[{"role":"user","content":7}]}', "/v1/responses", "invalid_type"),
        (b'{"model":"m","instructions":1,"input":"x"}', "/v1/responses", "invalid_type"),
        (b'{"model":"m"}', "/v1/responses", "missing_input"),
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


def test_bad_requests_name_the_field() -> None:
    with pytest.raises(BadRequest, match=r"prompt\[1\]"):
        parse(b'{"model":"m","prompt":[1,"a"]}', "/v1/completions")
    with pytest.raises(BadRequest, match=r"prompt\[1\]"):
        parse(b'{"model":"m","prompt":[[1],"a"]}', "/v1/completions")
    with pytest.raises(BadRequest, match=r"input\[0\]\.content"):
        parse(b'{"model":"m","input":[{"role":"user","content":7}]}', "/v1/responses")


def test_token_id_prompt() -> None:
    f = parse(b'{"model":"m","prompt":[1,2,3]}', "/v1/completions")
    assert (f.api, f.prompt, f.first_message, f.prompt_token_ids) == ("completions", None, None, (1, 2, 3))


def test_batch_of_token_lists_is_keyed_on_the_first() -> None:
    f = parse(b'{"model":"m","prompt":[[5,6],[7]]}', "/v1/completions")
    assert (f.prompt, f.prompt_token_ids) == (None, (5, 6))


def test_batch_of_strings_is_keyed_on_the_first() -> None:
    f = parse(b'{"model":"m","prompt":["first","second"]}', "/v1/completions")
    assert (f.prompt, f.first_message, f.prompt_token_ids) == ("first", "first", None)
    assert parse(b'{"model":"m","prompt":["only"]}', "/v1/completions").prompt == "only"


def test_integral_float_max_tokens_is_an_integer() -> None:
    f = parse(b'{"model":"m","prompt":"p","max_tokens":4.0}', "/v1/completions")
    assert f.max_tokens == 4 and isinstance(f.max_tokens, int)
    assert parse(b'{"model":"m","messages":[],"max_completion_tokens":2.0}').max_tokens == 2


def test_responses_input_and_instructions() -> None:
    f = parse(b'{"model":"m","instructions":"I","input":"hello","max_output_tokens":3.0}', "/v1/responses")
    assert (f.api, f.system, f.first_message, f.max_tokens) == ("responses", "I", "hello", 3)
    f = parse(
        b'{"model":"m","input":[{"role":"developer","content":"D"},'
        b'{"type":"message","role":"user","content":[{"type":"input_text","text":"U"}]},'
        b'{"type":"function_call_output","call_id":"c","output":"o"}]}',
        "/v1/responses",
    )
    assert (f.system, f.first_message) == ("D", "U")


def test_responses_stored_prompt_is_keyed_on_its_id_and_version() -> None:
    f = parse(b'{"prompt":{"id":"pmpt_1","version":"2","variables":{"city":"Paris"}}}', "/v1/responses")
    assert f.api == "responses" and f.model is None  # the stored prompt may name the model
    g = parse(b'{"model":"m","prompt":{"id":"pmpt_1","version":"2","variables":{"city":"Rome"}},"input":"q"}',
              "/v1/responses")  # fmt: skip
    assert f.system == g.system == "stored prompt pmpt_1 version 2"
    assert parse(b'{"model":"m","prompt":{"id":"pmpt_1"},"input":"q"}', "/v1/responses").system != g.system


def test_other_paths_with_odd_prompts_are_routed() -> None:
    f = parse(b'{"model":"m","prompt":{"x":1}}', "/v1/something")
    assert f.api == "other" and f.prompt is None
    assert parse(b'{"model":"m","prompt":[9,8]}', "/v1/something").prompt_token_ids == (9, 8)
