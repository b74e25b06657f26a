"""The Redis KV index's wire format: pack_keys's 8-byte big-endian fields (the holds script's argument, equal
to the hash fields written with PACK), the tier bytes the script tests, and parse_holds, which treats the
script's reply as untrusted input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.kv.redis_layout import HOLDS_LUA, PACK, TIER, pack_keys, parse_holds
from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

u64 = st.integers(0, (1 << 64) - 1)


@given(keys=st.lists(u64, max_size=50))
def test_packed_keys_are_the_hash_fields_one_after_another(keys: list[int]) -> None:
    blob = pack_keys(keys)
    assert len(blob) == 8 * len(keys)
    assert [blob[i : i + 8] for i in range(0, len(blob), 8)] == [PACK.pack(k) for k in keys]
    assert [PACK.unpack(blob[i : i + 8])[0] for i in range(0, len(blob), 8)] == keys


def test_a_key_outside_64_bits_is_refused_not_truncated() -> None:
    for bad in (-1, 1 << 64):
        with pytest.raises(struct.error):
            pack_keys([1, bad])


def test_the_scripts_gpu_test_reads_the_tier_byte_written_for_gpu_hot() -> None:
    assert set(TIER) == {StorageTier.GPU_HOT, StorageTier.STORAGE_WARM}
    assert len({*TIER.values()}) == 2 and all(len(b) == 1 for b in TIER.values())
    assert f"if t ~= '{TIER[StorageTier.GPU_HOT].decode()}' then gpu = 0 end" in HOLDS_LUA


def test_a_reply_parses_into_holds_by_backend() -> None:
    reply = [b"a", 3, 1, b"b", 2, 0, "c", b"7", b"1"]  # names as bytes or str, counts as ints or digit strings
    assert parse_holds(reply) == {
        "a": BackendHold(3, StorageTier.GPU_HOT),
        "b": BackendHold(2, StorageTier.STORAGE_WARM),
        "c": BackendHold(7, StorageTier.GPU_HOT),
    }
    assert parse_holds([]) == {}
    assert parse_holds(["é".encode(), 1, 0]) == {"é": BackendHold(1, StorageTier.STORAGE_WARM)}


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        pytest.param(None, ValueError, id="not-a-list"),
        pytest.param((b"a", 1, 1), ValueError, id="a-tuple"),
        pytest.param([b"a", 1], ValueError, id="not-triples"),
        pytest.param([b"a", -1, 1], ValueError, id="negative-count"),
        pytest.param([b"a", b"many", 1], ValueError, id="count-not-a-number"),
        pytest.param([b"a", None, 1], TypeError, id="count-missing"),
        pytest.param([b"\xff", 1, 1], ValueError, id="name-not-utf8"),
        pytest.param([b"a", 1, b"yes"], ValueError, id="gpu-flag-not-a-number"),
    ],
)
def test_a_reply_of_another_shape_is_refused(reply: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_holds(reply)
