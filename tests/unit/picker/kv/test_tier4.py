"""Token-id prompts: the Tier 1 prefix key from the ids, Tier 4 block keys without a tokenizer round trip."""

from __future__ import annotations

import struct
from hashlib import sha256

from picker.config import KvCacheIndexConfig, PoolConfig
from picker.facts import RequestFacts, parse_request
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.routing.prefix_key import prefix_key
from picker.shared.block_keys import request_block_keys


def facts(body: bytes) -> RequestFacts:
    return parse_request(body, "/v1/completions", max_body_bytes=1 << 20)


def test_prefix_key_of_a_token_prompt_hashes_its_ids() -> None:
    f = facts(b'{"model":"m","prompt":[1,2,3]}')
    want = sha256(b"m" + b"\x00T" + struct.pack("<3I", 1, 2, 3)).digest()
    assert prefix_key(f, enabled=True, max_prefix_length=1024) == want
    # max_prefix_length bytes at 4 bytes an id: 8 bytes keep the first two ids
    assert prefix_key(f, enabled=True, max_prefix_length=8) == prefix_key(
        facts(b'{"model":"m","prompt":[1,2,99]}'), enabled=True, max_prefix_length=8
    )
    assert prefix_key(f, enabled=True, max_prefix_length=1) is not None  # at least one id
    # a batch of token lists is keyed on its first list; the key differs from a text prompt's
    assert prefix_key(facts(b'{"model":"m","prompt":[[1,2,3],[4]]}'), enabled=True, max_prefix_length=1024) == want
    assert prefix_key(facts(b'{"model":"m","prompt":"1 2 3"}'), enabled=True, max_prefix_length=1024) != want


class _NoTokenizer:
    calls = 0

    async def token_ids(self, model: str, *, messages: object = None, prompt: object = None) -> list[int] | None:
        self.calls += 1
        return None

    async def close(self) -> None:
        return None


async def test_tier4_uses_the_ids_as_sent() -> None:
    cfg = KvCacheIndexConfig(enabled=True)
    t4 = Tier4(cfg, Pool(PoolConfig()), PickerMetrics())
    tok = _NoTokenizer()
    t4.tokenizer = tok
    looked_up: list[object] = []

    async def holds(keys: object) -> dict[str, object]:
        looked_up.append(keys)
        return {}

    t4.index.holds = holds  # type: ignore[method-assign,assignment]
    ids = list(range(40))
    f = facts(b'{"model":"m","prompt":[' + ",".join(map(str, ids)).encode() + b"]}")
    assert (await t4.lookup(f)).holds == {}
    assert tok.calls == 0  # no tokenizer round trip
    bs = cfg.tokenizer.block_size
    assert looked_up == [request_block_keys(ids, bs, "m", None, None, t4.max_blocks)]
    # a text prompt still asks the tokenizer
    await t4.lookup(facts(b'{"model":"m","prompt":"hello"}'))
    assert tok.calls == 1
