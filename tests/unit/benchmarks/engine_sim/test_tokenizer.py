"""The simulator's tokenizer and chat template (used offline by the harness and picker tests)."""

from __future__ import annotations

import pytest

from benchmarks.engine_sim import tokenizer as tok


def test_one_token_per_word_and_prefix_preserving() -> None:
    a, b = "alpha beta  gamma", "delta\nepsilon"
    assert len(tok.encode(a)) == 3
    assert tok.encode(a + " " + b) == tok.encode(a) + tok.encode(b)
    assert all(tok.FIRST_WORD_ID <= t < tok.VOCAB_SIZE for t in tok.encode(a))
    assert tok.encode("<|user|> <|id:42|>") == [tok.SPECIAL_TOKENS["<|user|>"], 42]


def test_chat_template_and_history_prefix() -> None:
    turn1 = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]},
    ]
    assert tok.render_chat(turn1) == "<|system|> be brief <|end|> <|user|> hello <|end|> <|assistant|>"
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    ids1, ids2 = tok.chat_token_ids(turn1), tok.chat_token_ids(turn2)
    assert ids2[: len(ids1)] == ids1
    assert tok.request_token_ids("/v1/chat/completions", {"messages": turn1}) == ids1
    assert tok.request_token_ids("/v1/completions", {"prompt": "a b c"}) == tok.encode("a b c")
    assert tok.request_token_ids("/v1/completions", {"prompt": [[5, 6]]}) == [5, 6]


@pytest.mark.parametrize(
    "messages",
    [[{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], ["nope"], "text"],
)
def test_template_rejects_bad_messages(messages: object) -> None:
    with pytest.raises(tok.TemplateError):
        tok.render_chat(messages)  # type: ignore[arg-type]


def test_detokenizer_round_trip() -> None:
    d = tok.Detokenizer()
    d.remember("known words")
    ids = tok.encode("<|user|> known words")
    assert d.decode(ids) == "<|user|> known words"
    text = d.decode([*ids, 31999])
    assert tok.encode(text) == [*ids, 31999]


def test_output_words_are_deterministic() -> None:
    ids = tok.encode("a b c")
    assert tok.output_words(ids, 4) == tok.output_words(ids, 4)
    assert len(tok.encode(" ".join(tok.output_words(ids, 7)))) == 7
