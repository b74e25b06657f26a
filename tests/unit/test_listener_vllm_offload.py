"""A block offloaded by real vLLM to CPU and STORAGE stays in the index while any copy is left (issue 20).

The payloads of ``data/vllm_offload_sequence.hex`` (one per line) were produced by vLLM 0.32's own code (the
CPU build of ``.venv-engines``): ``BlockPool`` for the GPU events, the offloading connector's
``OffloadingEventsTracker`` with self-describing events for the CPU and STORAGE ones, each ``KVEventBatch``
encoded as its ``ZmqEventPublisher`` does (msgspec msgpack), with ``ts`` fixed. Regenerate them with
``.venv-engines/bin/python -m tests.engines.vllm_offload_events > tests/unit/data/vllm_offload_sequence.hex``.

The six batches: GPU store of two 32-token pages (64 tokens); CPU store of that chunk (both page hashes, its
64 tokens, ``block_size`` 32, ``kv_cache_spec_kind`` full_attention); STORAGE store (``locality`` LOCAL,
``ownership`` kvcr); GPU eviction (one removal per page); STORAGE removal; CPU removal.

``data/vllm033_offload_sequence.hex``: the same sequence from vLLM 0.33 (the generator's ``--vllm-src`` with
the vllm-0.33.0 wheel unpacked: its ``vllm/distributed/kv_events.py``, ``vllm/v1/kv_offload/base.py`` and
``.../kv_connector/v1/offloading/events.py`` over the installed 0.32). 0.33 publishes the same events: its
``BlockStored`` (kv_events.py lines 56-98: still a tagged map struct, ``omit_defaults``) only gains a last
field, ``lookahead_token_ids`` (None unless lookahead hashing is on, so omitted). With 15 fields plus the tag
(14 plus the tag in 0.32) a store no longer fits msgspec's fixmap header, so every store's map header is a
map16 (``de 00 0a`` where 0.32 wrote ``8a``) with the same entries. The removals (``BlockRemoved``, lines
123-130) are unchanged to the byte. The listener keeps the keys with both.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.events import BlockRemoved, BlockStored
from listener.msgpack_decoder import decode_batch
from listener.state_log import EventLog, compact
from picker.shared.block_keys import request_block_keys
from tests.support.recording_sink import RecordingSink

MODEL = "m"
KB = 16  # the feed's key block size (the default)
TOKENS = list(range(1000, 1064))  # the prompt's two full pages of 32
FIXTURES = {"vllm-0.32": "vllm_offload_sequence.hex", "vllm-0.33": "vllm033_offload_sequence.hex"}
SEQUENCES = {
    release: [bytes.fromhex(line) for line in (Path(__file__).parent / "data" / name).read_text().split()]
    for release, name in FIXTURES.items()
}
GPU_STORE, CPU_STORE, STORAGE_STORE, GPU_EVICTION, STORAGE_REMOVAL, CPU_REMOVAL = range(6)


class Listener:
    """Decoder + tracker (+ the state log a listener with ``state.path`` keeps), as a ZMQ source applies them."""

    def __init__(self, offload: bool = False, slice_blocks: int = 1024) -> None:
        src = SourceConfig(
            backend_name="vllm-0",
            engine="vllm",
            model=MODEL,
            zmq_endpoint="tcp://x:1",
            treat_eviction_as_offload=offload,
        )
        self.offload = offload
        self.slice_blocks = slice_blocks
        self.sink = RecordingSink()
        self.counts: dict[str, int] = {}
        self.tracker = BlockChainTracker(src, LimitsConfig(), self.sink, self._count, key_block_size=KB)
        self.log = EventLog(treat_eviction_as_offload=offload)

    def _count(self, reason: str, n: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def apply(self, payload: bytes) -> None:
        batch = decode_batch(payload, "vllm", LimitsConfig().max_event_tokens)
        assert batch.dropped == [] and batch.ignored == 0
        for unit in work_units(batch.events, self.slice_blocks):
            self.tracker.apply_all(unit)
        self.log.record_events(batch.raw_events)

    def restarted(self) -> Listener:
        """A listener restored from this one's compacted log."""
        other = Listener(self.offload, self.slice_blocks)
        events = compact(self.log.view()).events
        if events:
            other.apply(msgpack.packb([0.0, [msgpack.unpackb(e) for e in events]]))
        return other


def keys() -> list[int]:
    return request_block_keys(TOKENS, KB, MODEL)


@pytest.mark.parametrize("release", SEQUENCES)
def test_the_fixture_is_what_vllm_publishes_for_an_offloaded_block(release: str) -> None:
    payloads = SEQUENCES[release]
    events = [decode_batch(p, "vllm", 1 << 20).events for p in payloads]
    (gpu,) = events[GPU_STORE]
    hashes = gpu.block_hashes
    assert isinstance(gpu, BlockStored) and len(hashes) == 2 and gpu.block_size == 32 and gpu.medium == "GPU"
    assert gpu.token_ids == TOKENS and gpu.parent_hash is None
    for at, medium in ((CPU_STORE, "CPU"), (STORAGE_STORE, "STORAGE")):
        (ev,) = events[at]
        # self-describing: the chunk's page hashes with its tokens, not a placeholder
        assert isinstance(ev, BlockStored) and ev.medium == medium
        assert (ev.block_hashes, ev.token_ids, ev.block_size, ev.secondary_group) == (hashes, TOKENS, 32, False)
    assert sorted(h for ev in events[GPU_EVICTION] for h in ev.block_hashes) == sorted(hashes)
    for at, medium in ((STORAGE_REMOVAL, "STORAGE"), (CPU_REMOVAL, "CPU")):
        (ev,) = events[at]
        assert isinstance(ev, BlockRemoved) and ev.medium == medium and ev.block_hashes == hashes
    raw = msgpack.unpackb(payloads[STORAGE_STORE])[1][0]
    assert (raw["locality"], raw["ownership"]) == ("LOCAL", "kvcr")


def _event_bytes(payload: bytes) -> list[bytes]:
    """Each event of a batch as the publisher encoded it (``[ts, events, dp_rank]``, events a msgpack array)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    assert unpacker.read_array_header() == 3
    unpacker.skip()  # ts
    out = []
    for _ in range(unpacker.read_array_header()):
        start = unpacker.tell()
        unpacker.skip()
        out.append(payload[start : unpacker.tell()])
    return out


def test_vllm_033_publishes_the_same_events_with_wider_store_map_headers() -> None:
    """0.33 changes the encoding of the stores (a map16 header), not what any event says."""
    old, new = SEQUENCES["vllm-0.32"], SEQUENCES["vllm-0.33"]
    assert [msgpack.unpackb(p) for p in new] == [msgpack.unpackb(p) for p in old]
    for at, (a, b) in enumerate(zip(old, new, strict=True)):
        for ev32, ev33 in zip(_event_bytes(a), _event_bytes(b), strict=True):
            if at in (GPU_STORE, CPU_STORE, STORAGE_STORE):  # BlockStored: fixmap in 0.32, map16 in 0.33
                assert ev32[0] & 0xF0 == 0x80 and ev33[:3] == b"\xde\x00" + bytes([ev32[0] & 0x0F])
                assert ev33[3:] == ev32[1:]
            else:  # BlockRemoved: the same bytes
                assert ev33 == ev32
        assert decode_batch(b, "vllm", 1 << 20).events == decode_batch(a, "vllm", 1 << 20).events


@pytest.mark.parametrize("release", SEQUENCES)
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "treat_eviction_as_offload"])
@pytest.mark.parametrize("slice_blocks", [1024, 1])
def test_cpu_copy_keeps_the_keys_after_gpu_and_storage_removals(release: str, offload: bool, slice_blocks: int) -> None:
    live = Listener(offload, slice_blocks)
    expected = {
        GPU_STORE: "gpu_hot",
        CPU_STORE: "gpu_hot",
        STORAGE_STORE: "gpu_hot",
        GPU_EVICTION: "storage_warm",
        STORAGE_REMOVAL: "storage_warm",  # the CPU copy still holds the block
    }
    for at, payload in enumerate(SEQUENCES[release]):
        live.apply(payload)
        tier = expected.get(at)
        want = {} if tier is None else dict.fromkeys(keys(), tier)
        assert live.sink.state == want, f"after batch {at}"
        assert live.restarted().sink.state == want, f"restored after batch {at}"
    assert live.tracker.tracked_blocks == 0 and live.tracker.keyed_blocks == 0
    assert live.counts == {}
