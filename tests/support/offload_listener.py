"""What a listener holds for vLLM's offload sequence (tests/unit/data/vllm*_offload_sequence.hex): ``Listener``
(decoder + tracker + the state log, as a ZMQ source applies them), the keys of the offloaded prompt, and the
indexes of the sequence's steps."""

from __future__ import annotations

import msgpack

from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, SourceConfig
from listener.msgpack_decoder import decode_batch
from listener.state_log import EventLog, compact
from picker.shared.block_keys import request_block_keys
from tests.support.recording_sink import RecordingSink

MODEL = "m"
OFFLOAD_KB = 16  # the feed's key block size (the default)
OFFLOAD_TOKENS = list(range(1000, 1064))  # the prompt's two full pages of 32


GPU_STORE, CPU_STORE, STORAGE_STORE, GPU_EVICTION, STORAGE_REMOVAL, CPU_REMOVAL = range(6)


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
        self.tracker = BlockChainTracker(src, LimitsConfig(), self.sink, self._count, key_block_size=OFFLOAD_KB)
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


def offload_keys() -> list[int]:
    return request_block_keys(OFFLOAD_TOKENS, OFFLOAD_KB, MODEL)
