"""The tokenization cache's keys: prompt cuts (positions, whitespace, stability under appended text), the
points of a chat or a prompt (cumulative UTF-8 sizes, shared prefixes share keys, the tail only in the exact
key), and the safety margin's arithmetic."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from picker.kv.token_keys import (
    canonical_message,
    chain_digest,
    chat_segments,
    exact_digest,
    prompt_cuts,
    prompt_segments,
    root_digest,
    safe_length,
)

MODEL = "m"
prompts = st.text(st.sampled_from("ab é\n\t\r"), max_size=200)


@given(prompt=prompts, chunk=st.integers(1, 40))
def test_cuts_are_ascending_inside_the_prompt_and_at_whitespace(prompt: str, chunk: int) -> None:
    cuts = prompt_cuts(prompt, chunk)
    assert cuts == sorted(set(cuts))
    assert all(0 < c < len(prompt) and prompt[c] in " \n\t\r" for c in cuts)


@given(prompt=prompts, more=prompts, chunk=st.integers(1, 40))
def test_appending_text_keeps_every_earlier_cut(prompt: str, more: str, chunk: int) -> None:
    cuts = prompt_cuts(prompt, chunk)
    assert prompt_cuts(prompt + more, chunk)[: len(cuts)] == cuts


def test_a_cut_is_the_last_whitespace_before_each_edge() -> None:
    assert prompt_cuts("aa bb cc dd", 4) == [2, 5]  # edges 4 and 8 (12 is past the end)
    assert prompt_cuts("aaaa bb", 4) == []  # the only edge, 4, has no whitespace before it (edges are exclusive)
    assert prompt_cuts("a bcdefghij", 4) == [1]  # a window without whitespace adds no cut
    assert prompt_cuts(" abcdefgh", 4) == []  # position 0 is never a cut


def test_prompt_points_cover_the_text_before_each_cut_and_the_exact_key_the_rest() -> None:
    prompt = "ab cdé fg"  # é: two UTF-8 bytes
    seg = prompt_segments(MODEL, prompt, chunk=4)
    assert seg.cuts == prompt_cuts(prompt, 4) == [2, 6]
    assert seg.sizes == [2, 2 + len(" cdé".encode())]
    assert seg.total == len(prompt.encode())
    d1 = chain_digest(root_digest("prompt", MODEL), b"ab")
    d2 = chain_digest(d1, " cdé".encode())
    assert seg.keys == [d1, d2]
    assert seg.exact_key == exact_digest(chain_digest(d2, b" fg"))
    assert prompt_segments(MODEL, prompt + "!", chunk=4).keys[:2] == seg.keys  # a longer prompt shares the points
    assert prompt_segments(MODEL, prompt + "!", chunk=4).exact_key != seg.exact_key


def test_a_prompt_with_a_lone_surrogate_is_keyed() -> None:
    seg = prompt_segments(MODEL, "a \ud800 b", chunk=2)
    assert seg.total == len("a \ud800 b".encode("utf-8", "surrogatepass"))


def test_chat_points_are_one_per_message_and_conversations_share_their_prefix() -> None:
    m = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    longer = [*m, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    seg, nxt = chat_segments(MODEL, m), chat_segments(MODEL, longer)
    assert seg.cuts == [1, 2] and nxt.cuts == [1, 2, 3, 4]
    assert nxt.keys[:2] == seg.keys and seg.exact_key not in nxt.keys
    assert seg.sizes == [len(canonical_message(m[0])), len(canonical_message(m[0])) + len(canonical_message(m[1]))]
    assert seg.total == seg.sizes[-1] and seg.messages is m
    empty = chat_segments(MODEL, [])
    assert (empty.keys, empty.total, empty.exact_key) == ([], 0, exact_digest(root_digest("chat", MODEL)))


def test_a_model_name_cannot_be_shifted_into_the_kind() -> None:
    # the model is length-framed: no (kind, model) pair shares a root with another
    assert root_digest("chat", "x") != root_digest("chat", "x\x00")
    assert len({root_digest(k, m) for k in ("chat", "prompt") for m in ("", "a", "\x00a", "a\x00")}) == 8


@given(n=st.integers(0, 10_000), block=st.integers(1, 64))
def test_the_margin_drops_the_partial_block_and_one_more(n: int, block: int) -> None:
    kept = safe_length(n, block)
    assert kept % block == 0 and kept >= 0
    if n >= 2 * block:
        assert block <= n - kept < 2 * block
    else:
        assert kept == 0


def test_the_margin_at_block_edges() -> None:
    assert [safe_length(n, 16) for n in (0, 16, 31, 32, 47, 48, 64)] == [0, 0, 0, 16, 16, 32, 48]
