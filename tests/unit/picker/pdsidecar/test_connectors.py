"""The KV connectors' body rewriting (picker.pdsidecar.connectors): each leg's body exactly as llm-d's sidecar
contract says (docs/wire.md §8), and the decode answer's cached_tokens rewrite."""

from __future__ import annotations

import json

import orjson
import pytest

from picker.pdsidecar.connectors import (
    CONNECTORS,
    NIXL_PREFILL_PARAMS,
    BadPrefillAnswer,
    NixlV2,
    SGLang,
    SharedStorage,
    Target,
    cached_tokens,
    make_connector,
    one_token,
    parse_object,
    rewrite_cached_tokens,
    transfer_params,
)

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 100,
    "min_tokens": 10,
    "temperature": 0.2,
}
TARGET = Target("10.0.0.7:8000")
PRODUCED = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4], "remote_engine_id": "e",
            "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}  # fmt: skip


def test_one_token_forces_the_limits_and_turns_the_stream_off() -> None:
    out = one_token(BODY)
    assert out == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False, "max_tokens": 1,
        "min_tokens": 1, "temperature": 0.2, "max_completion_tokens": 1,
    }  # fmt: skip
    assert BODY["max_tokens"] == 100 and "stream_options" in BODY  # the client's body is not changed


def test_one_token_sets_both_limits_even_when_absent_but_min_tokens_only_when_given() -> None:
    # as llm-d's sidecar: max_tokens and max_completion_tokens are set either way; min_tokens alone would be new
    assert one_token({"prompt": "p"}) == {"prompt": "p", "stream": False, "max_tokens": 1, "max_completion_tokens": 1}


def test_nixlv2_legs() -> None:
    c = NixlV2()
    raw = orjson.dumps(BODY)
    prefill = json.loads(c.prefill_body(BODY, TARGET, 0))
    assert prefill == {**one_token(BODY), "kv_transfer_params": NIXL_PREFILL_PARAMS}
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None,
    }  # fmt: skip
    answer = orjson.dumps({"choices": [], "kv_transfer_params": PRODUCED})
    assert json.loads(c.decode_body(BODY, raw, TARGET, 0, answer)) == {**BODY, "kv_transfer_params": PRODUCED}
    assert c.rewrites_cached_tokens and not c.concurrent


def test_nixlv2_overrides_a_clients_own_transfer_params() -> None:
    body = {**BODY, "kv_transfer_params": {"remote_host": "203.0.113.1"}}
    c = NixlV2()
    assert json.loads(c.prefill_body(body, TARGET, 0))["kv_transfer_params"] == NIXL_PREFILL_PARAMS
    answer = orjson.dumps({"kv_transfer_params": PRODUCED})
    assert json.loads(c.decode_body(body, b"", TARGET, 0, answer))["kv_transfer_params"] == PRODUCED


@pytest.mark.parametrize(
    "answer", [b"not json", b"[1]", b'{"choices": []}', b'{"kv_transfer_params": null}', b'{"kv_transfer_params": 3}']
)
def test_a_prefill_answer_without_transfer_params_is_refused(answer: bytes) -> None:
    with pytest.raises(BadPrefillAnswer):
        transfer_params(answer)
    with pytest.raises(BadPrefillAnswer):
        NixlV2().decode_body(BODY, b"", TARGET, 0, answer)


def test_shared_storage_legs() -> None:
    c = SharedStorage()
    raw = b'{"model":"m",  "stream": true}'
    assert json.loads(c.prefill_body(BODY, TARGET, 0)) == one_token(BODY)
    assert c.decode_body(BODY, raw, TARGET, 0, b"{}") is raw  # the client's bytes, untouched
    assert not c.rewrites_cached_tokens and not c.concurrent


@pytest.mark.parametrize(("address", "host"), [("10.0.0.7:8000", "10.0.0.7"), ("[fd00::0:7]:8000", "fd00::7")])
def test_sglang_injects_the_same_bootstrap_fields_into_both_legs(address: str, host: str) -> None:
    c = SGLang(bootstrap_port=9000)
    target = Target(address)
    expected = {**BODY, "bootstrap_host": host, "bootstrap_port": 9000, "bootstrap_room": 42}
    assert json.loads(c.prefill_body(BODY, target, 42)) == expected
    assert json.loads(c.decode_body(BODY, b"", target, 42, b"")) == expected
    assert c.concurrent


def test_connectors_by_name() -> None:
    assert list(CONNECTORS) == ["nixlv2", "shared-storage", "sglang"]
    assert make_connector("nixlv2") == NixlV2()
    assert make_connector("sglang", 7000) == SGLang(bootstrap_port=7000)
    with pytest.raises(ValueError, match="unknown KV connector 'lmcache'"):
        make_connector("lmcache")


def test_parse_object() -> None:
    assert parse_object(b'{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError, match="not JSON"):
        parse_object(b"{")
    with pytest.raises(ValueError, match="not an object"):
        parse_object(b'"text"')


def test_cached_tokens_of_an_answer() -> None:
    assert cached_tokens(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}') == 16
    # vLLM gives null details when nothing was cached
    for answer in (b'{"usage": {"prompt_tokens_details": null}}', b"{}", b"junk", b'{"usage": 1}',
                   b'{"usage": {"prompt_tokens_details": {"cached_tokens": true}}}'):  # fmt: skip
        assert cached_tokens(answer) == 0


def test_rewrite_cached_tokens() -> None:
    answer = b'{"id": "d", "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8, "x": 1}}}'
    out = rewrite_cached_tokens(answer, 3)
    assert out is not None
    assert json.loads(out) == {
        "id": "d",
        "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3, "x": 1}},
    }
    # the details made when absent or null, as llm-d does
    out = rewrite_cached_tokens(b'{"usage": {"prompt_tokens_details": null}}', 3)
    assert out is not None and json.loads(out) == {"usage": {"prompt_tokens_details": {"cached_tokens": 3}}}
    # no usage, or not a JSON object: left as it is
    assert rewrite_cached_tokens(b'{"id": "d"}', 3) is None
    assert rewrite_cached_tokens(b"data: {}\n\n", 3) is None
