"""Listener keys equal the picker's for what real vLLM 0.33 and SGLang 0.5.23 publish (docs/wire.md §3-4):
salt and LoRA in extra_keys, KV-cache groups, copies per medium, CPU placeholders, any page size.
Decoder + tracker, no sockets; the feed's key block size is the default (16)."""

from __future__ import annotations

from typing import Any

import msgpack

from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored
from listener.msgpack_decoder import decode_batch
from picker.shared.block_keys import request_block_keys
from tests.support.recording_sink import RecordingSink

KB = 16
MODEL = "m"
TOKENS = list(range(2000, 2000 + 8 * KB))


class Rig:
    def __init__(self, engine: str = "vllm", limits: LimitsConfig | None = None, **kw: Any) -> None:
        src = SourceConfig(backend_name="b", engine=engine, model=MODEL, zmq_endpoint="tcp://x:1", **kw)
        self.sink = RecordingSink()
        self.counts: dict[str, int] = {}
        self.engine = engine
        self.tracker = BlockChainTracker(src, limits or LimitsConfig(), self.sink, self._count)

    def _count(self, reason: str, n: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def send(self, *events: dict[str, Any]) -> list[str]:
        batch = decode_batch(msgpack.packb([0.0, list(events), 0]), self.engine, 1 << 20)
        for ev in batch.events:
            self.tracker.apply(ev)
        return batch.dropped

    @property
    def state(self) -> dict[int, str]:
        return self.sink.state


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = KB, **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "medium": "GPU", **kw}  # fmt: skip


def removed(hashes: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def keys(n_blocks: int, **kw: Any) -> list[int]:
    return request_block_keys(TOKENS[: n_blocks * KB], KB, MODEL, **kw)


# -- case 2: extra_keys (vLLM), cache_salt / lora_name (SGLang) ------------------------------------------
def test_vllm_salt_in_first_block_extra_keys() -> None:
    r = Rig()
    assert r.send(stored([1, 2], None, TOKENS[: 2 * KB], extra_keys=[["tenant-1"], None])) == []
    r.send(stored([3], 2, TOKENS[2 * KB : 3 * KB]))  # a child: the salt is inherited through the parent
    assert set(r.state) == set(keys(3, cache_salt="tenant-1"))


def test_vllm_lora_on_every_block_and_with_salt() -> None:
    r = Rig()
    r.send(stored([1, 2], None, TOKENS[: 2 * KB], lora_id=7, lora_name="ad", extra_keys=[["ad"], ["ad"]]))
    r.send(stored([3], 2, TOKENS[2 * KB : 3 * KB], lora_id=7, lora_name="ad", extra_keys=[["ad"]]))
    assert set(r.state) == set(keys(3, lora_name="ad"))
    r2 = Rig()
    r2.send(stored([1, 2], None, TOKENS[: 2 * KB], lora_id=7, lora_name="ad", extra_keys=[["ad", "s"], ["ad"]]))
    assert set(r2.state) == set(keys(2, lora_name="ad", cache_salt="s"))


def test_vllm_multimodal_extras_leave_block_and_descendants_unkeyed() -> None:
    r = Rig()
    r.send(stored([1, 2, 3], None, TOKENS[: 3 * KB], extra_keys=[None, ["mm-hash-a"], None]))
    r.send(stored([4], 3, TOKENS[3 * KB : 4 * KB]))
    assert set(r.state) == set(keys(1))
    assert r.counts["multimodal"] == 2 and r.counts["unattributed_parent"] == 1
    r2 = Rig()  # on the first block, a salt and a multimodal hash: two extras, not a salt
    r2.send(stored([1], None, TOKENS[:KB], extra_keys=[["tenant-1", "mm-hash-a"]]))
    assert r2.state == {} and r2.counts["multimodal"] == 1


def test_sglang_salt_and_lora_fields() -> None:
    r = Rig(engine="sglang")
    r.send(stored([-5], None, TOKENS[:KB], cache_salt="t", lora_id=1, lora_name="ad"))
    r.send(stored([-6], -5, TOKENS[KB : 2 * KB], cache_salt="t", lora_id=1, lora_name="ad"))
    assert set(r.state) == set(keys(2, lora_name="ad", cache_salt="t"))


# -- case 3: KV-cache groups ----------------------------------------------------------------------------
def test_removal_in_one_group_keeps_a_block_another_group_holds() -> None:
    r = Rig()
    r.send(stored([1, 2], None, TOKENS[: 2 * KB], group_idx=0), stored([1, 2], None, TOKENS[: 2 * KB], group_idx=1))
    r.send(removed([2], group_idx=1))
    assert set(r.state) == set(keys(2))
    r.send(removed([2], group_idx=0))
    assert set(r.state) == set(keys(1))


def test_sliding_window_group_does_not_keep_or_poison_a_block() -> None:
    r = Rig()
    sw = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128}
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    # the sliding-window group announces a "null" page first (fails the page check): ignored
    r.send(stored([1], None, [], **sw), stored([1, 2], None, TOKENS[: 2 * KB], **full))
    r.send(stored([1, 2], None, TOKENS[: 2 * KB], **sw))
    assert set(r.state) == set(keys(2)) and r.counts["null_block"] == 1
    r.send(removed([1, 2], group_idx=1))  # the window slid: full attention still holds both
    assert set(r.state) == set(keys(2))
    r.send(stored([2], 1, TOKENS[KB : 2 * KB], **sw))
    r.send(removed([2], group_idx=0))  # only the sliding window holds it now: not a usable prefix
    assert set(r.state) == set(keys(1))


def test_a_store_failing_the_page_check_never_changes_a_known_block() -> None:
    r = Rig()
    r.send(stored([1], None, TOKENS[:KB]))
    r.send(stored([1], None, TOKENS[:3], group_idx=1))
    r.send(removed([1], group_idx=0))
    assert r.state == {} and r.tracker.tracked_blocks == 0
    r.send(stored([9], None, TOKENS[:3]), stored([9], None, TOKENS[:KB], group_idx=1))  # mismatch first
    assert set(r.state) == set(keys(1))


# -- case 4: copies and media ---------------------------------------------------------------------------
def test_two_copies_need_two_removals() -> None:
    r = Rig()
    r.send(stored([1], None, TOKENS[:KB]), stored([1], None, TOKENS[:KB]))
    r.send(removed([1]))
    assert set(r.state) == set(keys(1))
    r.send(removed([1]))
    assert r.state == {}


def test_each_medium_counted_separately() -> None:
    r = Rig()
    for medium in ("GPU", "CPU", "STORAGE"):
        r.send(stored([1], None, TOKENS[:KB], medium=medium))
    (key,) = keys(1)
    r.send(removed([1]))
    assert r.state == {key: "storage_warm"}
    r.send(removed([1], medium="STORAGE"))
    assert r.state == {key: "storage_warm"}  # still on CPU
    r.send(removed([1], medium="CPU"))
    assert r.state == {}


def test_eviction_as_offload_kept() -> None:
    r = Rig(treat_eviction_as_offload=True)
    r.send(stored([1], None, TOKENS[:KB]))
    r.send(removed([1]))
    assert r.state == dict.fromkeys(keys(1), "storage_warm")
    r.send(removed([1], medium="CPU"))
    assert r.state == {}


# -- case 5: CPU offloading placeholders ----------------------------------------------------------------
def test_cpu_placeholder_adds_a_copy_of_a_known_block() -> None:
    r = Rig()
    r.send(stored([1, 2], None, TOKENS[: 2 * KB]))
    dropped = r.send(stored([1, 2, 77], None, [], bs=0, medium="CPU"))
    assert dropped == [] and r.counts["placeholder_unknown"] == 1
    r.send(removed([2]))
    assert r.state == {keys(1)[0]: "gpu_hot", keys(2)[1]: "storage_warm"}
    assert r.tracker.tracked_blocks == 2


# -- case 6: any page size, regrouped into key blocks ---------------------------------------------------
def test_vllm_pages_of_32_and_64() -> None:
    r = Rig()
    r.send(stored([1, 2], None, TOKENS[:64], bs=32), stored([3], 2, TOKENS[64:128], bs=64))
    assert set(r.state) == set(keys(8))
    assert r.tracker.keys_of(2) == tuple(keys(4)[2:])
    r.send(removed([3]))
    assert set(r.state) == set(keys(4))


def test_sglang_page_size_one() -> None:
    r = Rig(engine="sglang")
    parent = None
    for i in range(40):
        r.send(stored([-(i + 1)], parent, [TOKENS[i]], bs=1))
        parent = -(i + 1)
    assert set(r.state) == set(keys(2))
    r.send(removed([-(i + 1) for i in range(39, 31, -1)]))  # the last 8 pages own no key
    assert set(r.state) == set(keys(2))
    r.send(removed([-32]))  # the page holding token 31 owns key block 1
    assert set(r.state) == set(keys(1))


def test_pages_not_dividing_the_key_block_and_partial_last_page() -> None:
    r = Rig()
    r.send(stored([1, 2], None, TOKENS[:48], bs=24))
    assert r.tracker.keys_of(1) == (keys(1)[0],) and r.tracker.keys_of(2) == tuple(keys(3)[1:])
    s = Rig(engine="sglang")
    s.send(stored([-1], None, TOKENS[:KB]), stored([-2], -1, TOKENS[KB : KB + 8], bs=8))  # partial last page
    assert set(s.state) == set(keys(1))
    s.send(stored([-3], -2, TOKENS[KB + 8 : 2 * KB], bs=8))
    assert set(s.state) == set(keys(2))


def test_page_size_one_memory_bounds() -> None:
    limits = LimitsConfig(max_tracked_blocks=300, max_retained_tokens=200, max_chain_tokens=256)
    r = Rig(engine="sglang", limits=limits)
    h = 0
    for chain in range(20):
        parent = None
        for i in range(400):
            h += 1
            r.send(stored([h], parent, [chain * 1000 + i], bs=1))
            parent = h
            assert r.tracker.tracked_blocks <= 300 and r.tracker.retained_tokens <= 200
    assert r.counts["chain_too_long"] > 0 and r.counts["pruned_blocks"] > 0
    assert 0 < len(r.state) <= 300 // 1


# -- case 7: sliced application -------------------------------------------------------------------------
def test_work_units_bound_slices_and_keep_the_effect() -> None:
    events = [
        BlockStored(tuple(range(1, 8)), None, TOKENS[: 7 * KB], KB, unkeyable_from=5),
        BlockStored((20,), 7, TOKENS[7 * KB : 8 * KB], KB),
        BlockRemoved((6, 5, 4)),
    ]
    units = list(work_units(events, 3))
    assert all(sum(len(e.block_hashes) for e in u if isinstance(e, BlockStored | BlockRemoved)) <= 3 for u in units)
    whole, sliced = Rig(), Rig()
    for ev in events:
        whole.tracker.apply(ev)
    for unit in units:
        sliced.tracker.apply_all(unit)
    assert sliced.state == whole.state == dict.fromkeys(keys(3), "gpu_hot")
    assert sliced.tracker.tracked_blocks == whole.tracker.tracked_blocks == 5
