"""Tokenizer sources: engine /tokenize (chat and prompt, timeout, errors → None), local, none.

The tests that start a server or bind a socket: tests/integration/test_tokenizer_sources_http.py."""

from __future__ import annotations

from picker.config import TokenizerConfig
from picker.kv.tokenizer_sources import (
    NoTokenizer,
    local_tokenizer_available,
    make_tokenizer_source,
)


async def test_none_and_factory() -> None:
    assert await NoTokenizer().token_ids("m", prompt="x") is None
    assert isinstance(make_tokenizer_source(TokenizerConfig(source="none")), NoTokenizer)
    src = make_tokenizer_source(TokenizerConfig(source="local", local_path="/nonexistent/tokenizer.json"))
    if not local_tokenizer_available():
        assert isinstance(src, NoTokenizer)  # optional extra not installed: Tier 4 off, no crash
    assert await src.token_ids("m", prompt="x") is None


async def test_local_tokenizer_missing_file_is_none() -> None:
    from picker.kv.tokenizer_sources import LocalTokenizer

    t = LocalTokenizer("/nonexistent/tokenizer.json", timeout_ms=2000)
    assert await t.token_ids("m", prompt="x") is None


async def test_local_tokenizer_encodes_prompt_and_chat_template(tmp_path) -> None:
    """A real tokenizer.json (word-level, built here) and a Jinja chat template file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from picker.kv.tokenizer_sources import LocalTokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "system": 2, "user": 3, "be": 4, "brief": 5, "hi": 6, "assistant": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    t = LocalTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"), timeout_ms=5000)
    assert await t.token_ids("m", prompt="be brief") == [4, 5]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert await t.token_ids("m", messages=msgs) == [2, 4, 5, 3, 6, 7]
    factory = make_tokenizer_source(
        TokenizerConfig(source="local", local_path=str(tmp_path / "tokenizer.json"), timeout_ms=5000)
    )
    assert await factory.token_ids("m", prompt="hi brief") == [6, 5]
    await t.close()
