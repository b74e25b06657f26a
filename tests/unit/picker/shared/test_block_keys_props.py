"""Properties of the block-key chain (picker.shared.block_keys.chain_block_keys), which the listener and
the picker must compute identically: a prefix of tokens gives a prefix of keys, each key depends on every
earlier block, a partial tail is ignored, and a LoRA name or cache salt (folded into the root) changes every key."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from picker.shared.block_keys import MAX_TOKEN_ID, block_key, chain_block_keys, root_key

PROPS = settings(max_examples=100, deadline=None)
tokens = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=96)
block_sizes = st.integers(1, 16)
parents = st.integers(0, 2**64 - 1)
names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


@PROPS
@given(tokens, block_sizes, parents, st.data())
def test_prefix_of_tokens_gives_prefix_of_keys(toks: list[int], bs: int, parent: int, data: st.DataObject) -> None:
    keys = chain_block_keys(toks, bs, parent)
    assert len(keys) == len(toks) // bs
    cut = data.draw(st.integers(0, len(toks)))
    assert chain_block_keys(toks[:cut], bs, parent) == keys[: cut // bs]
    assert chain_block_keys(toks, bs, parent, max_blocks=cut // bs) == keys[: cut // bs]


@PROPS
@given(tokens, block_sizes, parents)
def test_chain_is_iterated_block_key(toks: list[int], bs: int, parent: int) -> None:
    expected, key = [], parent
    for i in range(len(toks) // bs):
        key = block_key(key, toks[i * bs : (i + 1) * bs])
        expected.append(key)
    assert chain_block_keys(toks, bs, parent) == expected


@PROPS
@given(tokens, block_sizes, parents, st.data())
def test_partial_tail_is_ignored(toks: list[int], bs: int, parent: int, data: st.DataObject) -> None:
    full = toks[: len(toks) // bs * bs]
    tail = data.draw(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=bs - 1))
    assert chain_block_keys(full + tail, bs, parent) == chain_block_keys(full, bs, parent)


@PROPS
@given(tokens, block_sizes, parents, st.data())
def test_changing_a_token_changes_its_block_and_every_later_key_only(
    toks: list[int], bs: int, parent: int, data: st.DataObject
) -> None:
    n_full = len(toks) // bs * bs
    assume(n_full > 0)
    pos = data.draw(st.integers(0, n_full - 1))
    new = data.draw(st.integers(0, MAX_TOKEN_ID).filter(lambda t: t != toks[pos]))
    changed = [*toks[:pos], new, *toks[pos + 1 :]]
    before, after = chain_block_keys(toks, bs, parent), chain_block_keys(changed, bs, parent)
    i = pos // bs
    assert after[:i] == before[:i]  # earlier blocks do not see later tokens
    assert all(a != b for a, b in zip(after[i:], before[i:], strict=True))  # block i and every later one do


@PROPS
@given(tokens.filter(lambda t: len(t) >= 1), block_sizes, names, names, names)
def test_lora_and_salt_change_every_key(toks: list[int], bs: int, model: str, lora: str, salt: str) -> None:
    assume(lora or salt)
    plain = chain_block_keys(toks, bs, root_key(model))
    scoped = chain_block_keys(toks, bs, root_key(model, lora, salt))
    assert len(plain) == len(scoped)
    assert all(a != b for a, b in zip(plain, scoped, strict=True))


@PROPS
@given(tokens, block_sizes, names, names)
def test_models_do_not_share_keys(toks: list[int], bs: int, m1: str, m2: str) -> None:
    assume(m1 != m2)
    a, b = chain_block_keys(toks, bs, root_key(m1)), chain_block_keys(toks, bs, root_key(m2))
    assert all(x != y for x, y in zip(a, b, strict=True))
