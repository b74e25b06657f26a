"""The simulator's deterministic /v1/embeddings: OpenAI's shapes, similar texts similar, unrelated ones not."""

from __future__ import annotations

from benchmarks.engine_sim.embeddings import (
    DEFAULT_DIM,
    cosine,
    embed_text,
)
from tests.support.embedding_texts import LONG, ONE_WORD_CHANGED, UNRELATED


def test_same_text_same_unit_vector() -> None:
    a, b = embed_text(LONG), embed_text(LONG)
    assert a == b and len(a) == DEFAULT_DIM
    assert abs(sum(x * x for x in a) - 1.0) < 1e-9


def test_one_changed_word_stays_close_and_unrelated_questions_do_not() -> None:
    assert len(LONG.split()) >= 20
    assert cosine(embed_text(LONG), embed_text(ONE_WORD_CHANGED)) > 0.9
    assert cosine(embed_text(LONG), embed_text(LONG.lower() + "  ")) > 0.999  # case and spacing ignored
    for text in UNRELATED:
        assert cosine(embed_text(LONG), embed_text(text)) < 0.5, text


def test_texts_without_words_still_get_a_unit_vector() -> None:
    for text in ("?", "...", " "):
        v = embed_text(text)
        assert abs(sum(x * x for x in v) - 1.0) < 1e-9
