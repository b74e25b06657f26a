from hashlib import sha256

from picker.facts import parse_request
from picker.routing.prefix_key import prefix_key, truncate_utf8


def facts(body: bytes, path: str = "/v1/chat/completions"):
    return parse_request(body, path, max_body_bytes=1 << 20)


def key(body: bytes, path: str = "/v1/chat/completions", limit: int = 1024):
    return prefix_key(facts(body, path), enabled=True, max_prefix_length=limit)


def test_system_prompt_key_is_the_seed_formula() -> None:
    k = key(b'{"model":"llama","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi"}]}')
    assert k == sha256(b"llama\x00SBe brief.").digest()


def test_first_message_key_when_no_system_prompt() -> None:
    k = key(b'{"model":"llama","messages":[{"role":"user","content":"Be brief."}]}')
    assert k == sha256(b"llama\x00MBe brief.").digest()


def test_same_text_in_system_and_message_differ() -> None:
    s = key(b'{"model":"m","messages":[{"role":"system","content":"x"}]}')
    m = key(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert s != m


def test_model_separates_keys() -> None:
    a = key(b'{"model":"a","messages":[{"role":"system","content":"x"}]}')
    b = key(b'{"model":"b","messages":[{"role":"system","content":"x"}]}')
    assert a != b


def test_truncation_respects_utf8_boundaries() -> None:
    text = "한국어"  # 3 bytes per character
    assert truncate_utf8(text, 4) == "한".encode()
    assert truncate_utf8(text, 6) == "한국".encode()
    assert truncate_utf8(text, 100) == text.encode()
    assert truncate_utf8("a" + text, 3) == b"a"
    assert truncate_utf8("é", 1) == b""


def test_multibyte_prefix_truncation_groups_requests() -> None:
    limit = 7  # "한국" (6 bytes) + the first byte of the third character, which is backed off
    a = key('{"model":"m","messages":[{"role":"system","content":"한국어 A"}]}'.encode(), limit=limit)
    b = key('{"model":"m","messages":[{"role":"system","content":"한국말 B"}]}'.encode(), limit=limit)
    c = key('{"model":"m","messages":[{"role":"system","content":"한글 C"}]}'.encode(), limit=limit)
    assert a == b == sha256("m\x00S한국".encode()).digest()
    assert c != a


def test_long_prompts_share_key_beyond_limit() -> None:
    base = "x" * 2000
    a = key(('{"model":"m","messages":[{"role":"system","content":"' + base + 'A"}]}').encode())
    b = key(('{"model":"m","messages":[{"role":"system","content":"' + base + 'B"}]}').encode())
    assert a == b


def test_anthropic_system_string_and_blocks_agree() -> None:
    s = key(
        b'{"model":"c","system":"You review code.","messages":[{"role":"user","content":"x"}]}',
        "/v1/messages",
    )
    blocks = key(
        b'{"model":"c","system":[{"type":"text","text":"You review code."}],'
        b'"messages":[{"role":"user","content":"x"}]}',
        "/v1/messages",
    )
    assert s == blocks == sha256(b"c\x00SYou review code.").digest()


def test_anthropic_without_system_uses_first_message_blocks() -> None:
    k = key(
        b'{"model":"c","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}',
        "/v1/messages",
    )
    assert k == sha256(b"c\x00Mhello").digest()


def test_openai_content_parts() -> None:
    k = key(b'{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"sys"}]}]}')
    assert k == sha256(b"m\x00Ssys").digest()


def test_no_key_when_disabled_or_no_text() -> None:
    f = facts(b'{"model":"m","messages":[{"role":"system","content":"x"}]}')
    assert prefix_key(f, enabled=False, max_prefix_length=1024) is None
    assert key(b'{"model":"m","messages":[]}') is None
    assert key(b'{"model":"m","messages":[{"role":"user","content":""}]}') is None


def test_completions_prompt_counts_as_first_message() -> None:
    k = key(b'{"model":"m","prompt":"Once upon"}', "/v1/completions")
    assert k == sha256(b"m\x00MOnce upon").digest()
