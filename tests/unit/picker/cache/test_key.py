"""The exact cache's key and eligibility, from RequestFacts built directly: canonical (key order never matters),
the API and tenant bytes keyed, int64 bounds, unkeyable inputs, and the request-side eligibility rule."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from picker.cache.key import cache_key, eligible, key_material
from picker.facts import RequestFacts

MESSAGES = [{"role": "user", "content": "hi"}]


def facts(**kw: Any) -> RequestFacts:
    return RequestFacts(**{"api": "chat", "model": "m", **kw})


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **fields}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@given(extra=st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=5), seed=st.randoms())
def test_the_key_does_not_depend_on_the_bodys_key_order(extra: dict[str, Any], seed: Any) -> None:
    data = body(**extra)
    items = list(data.items())
    seed.shuffle(items)
    assert cache_key(facts(), dict(items)) == cache_key(facts(), data)


def test_a_body_field_named_api_cannot_forge_another_apis_key() -> None:
    chat = cache_key(facts(api="chat"), body())
    forged = cache_key(facts(api="chat"), body(api="anthropic"))
    assert cache_key(facts(api="anthropic"), body()) != chat
    assert forged == chat  # the path's API overwrites the body's field
    assert cache_key(facts(api="chat"), body(api="chat")) == chat


def test_the_conversation_is_the_prompt_for_completions_and_the_messages_otherwise() -> None:
    completions = key_material(facts(api="completions"), {"model": "m", "prompt": "abc"})
    assert completions is not None
    assert completions[2:34] == hashlib.sha256(b'"abc"').digest()  # after "m" and its separator
    chat = key_material(facts(), body(prompt="abc"))
    assert chat is not None and chat[2:34] == hashlib.sha256(b'[{"content":"hi","role":"user"}]').digest()


def test_max_tokens_is_keyed_across_the_whole_int64_range_and_refused_beyond() -> None:
    lo, hi = -(1 << 63), (1 << 63) - 1
    for mt in (lo, hi):
        m = key_material(facts(max_tokens=mt), body())
        assert m is not None and b"\x01" + struct.pack(">q", mt) + b"\x00" in m
    assert key_material(facts(max_tokens=hi + 1), body()) is None
    assert key_material(facts(max_tokens=lo - 1), body()) is None


def test_negative_zero_is_keyed_as_zero() -> None:
    assert cache_key(facts(temperature=-0.0, top_p=-0.0), body()) == cache_key(
        facts(temperature=0.0, top_p=0.0), body()
    )


def test_requests_that_cannot_be_keyed() -> None:
    assert cache_key(facts(model=None), body()) is None
    assert cache_key(facts(model="a\x00b"), body()) is None
    for tenant in ("acme\ufffd", "ac\x00me", "\ud800"):  # a lossy decode's U+FFFD, a NUL, a lone surrogate
        assert cache_key(facts(tenant_id=tenant), body()) is None, repr(tenant)
    assert cache_key(facts(), body(tools=[float("nan")])) is not None  # orjson writes NaN as null: still keyable


def test_a_tenant_is_keyed_on_its_raw_bytes() -> None:
    raw = b"acme\xff"
    m = key_material(facts(tenant_id=raw.decode("utf-8", "surrogateescape")), body())
    assert m is not None and b"\x01" + raw + b"\x00" in m


def test_only_the_shaping_headers_that_are_present_change_the_key() -> None:
    plain = cache_key(facts(), body())
    assert cache_key(facts(), body(), {"authorization": "Bearer x", "x-request-id": "1"}) == plain
    one = cache_key(facts(), body(), {"anthropic-version": "2023-06-01"})
    assert one != plain
    assert cache_key(facts(), body(), {"anthropic-version": "2023-06-01", "x-request-id": "2"}) == one


def test_eligibility_is_the_api_a_zero_or_absent_temperature_and_a_model() -> None:
    for api in ("chat", "completions", "anthropic"):
        assert eligible(facts(api=api))
        assert eligible(facts(api=api, temperature=0.0))
        assert eligible(facts(api=api, temperature=-0.0))
    assert not eligible(facts(temperature=1e-9))
    assert not eligible(facts(model=None))
    for api in ("responses", "other"):
        assert not eligible(facts(api=api))
