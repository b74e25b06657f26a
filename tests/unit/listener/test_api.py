"""listener.api, what the benchmarks may import: its names are the listener's own, and together they turn an
engine's payload into the keys the picker computes for the same tokens (what benchmarks.listener_hostile relies on)."""

from __future__ import annotations

import msgpack
import pytest

from listener import api
from listener.app import ListenerApp
from listener.block_chains import BlockChainTracker
from picker.shared.block_keys import request_block_keys
from tests.support.recording_sink import RecordingSink


def test_the_public_names_are_the_listeners_own() -> None:
    assert api.ListenerApp is ListenerApp and api.BlockChainTracker is BlockChainTracker
    assert sorted(api.__all__) == sorted(
        ["BlockChainTracker", "DecodeError", "LimitsConfig", "ListenerApp", "ListenerConfig", "SourceConfig",
         "decode_batch", "work_units"]
    )  # fmt: skip


def test_payload_to_keys_through_the_public_names() -> None:
    limits = api.LimitsConfig(apply_slice_blocks=2)
    src = api.SourceConfig(backend_name="e1", model="m", zmq_endpoint="tcp://127.0.0.1:1")
    sink = RecordingSink()
    tracker = api.BlockChainTracker(src, limits, sink, key_block_size=4)
    tokens = list(range(40, 60))  # five pages of 4
    payload = msgpack.packb([0.0, [["BlockStored", [1, 2, 3, 4, 5], None, tokens, 4, None, "GPU"]], 0])
    batch = api.decode_batch(payload, "vllm", limits.max_event_tokens, limits)
    units = list(api.work_units(batch.events, limits.apply_slice_blocks))
    assert len(units) == 3
    for unit in units:
        tracker.apply_all(unit)
    assert set(sink.state) == set(request_block_keys(tokens, 4, "m"))
    with pytest.raises(api.DecodeError):
        api.decode_batch(b"\xc1", "vllm", limits.max_event_tokens, limits)
    assert api.ListenerApp(api.ListenerConfig(sources=(src,))).sources["e1"].name == "e1"
