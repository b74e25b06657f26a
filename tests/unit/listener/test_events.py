"""listener.events: block hashes as unsigned 64-bit ints whatever the engine sent, the medium a copy is counted
under, the first unkeyable block of a store, and a source's health state."""

from __future__ import annotations

import time

import pytest

from listener.events import BlockStored, DecodeError, is_gpu_medium, medium_label, normalise_hash, source_status


def test_hash_normalisation() -> None:
    assert normalise_hash(-1) == (1 << 64) - 1
    assert normalise_hash((1 << 64) - 5) == (1 << 64) - 5
    assert normalise_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7
    assert normalise_hash((-2).to_bytes(8, "big", signed=True)) == normalise_hash(-2)
    for bad in ("x", True, 1 << 64, -(1 << 63) - 1, b"", 1.5):
        with pytest.raises(DecodeError) as exc:
            normalise_hash(bad)
        assert exc.value.reason == "malformed"


def test_media() -> None:
    for gpu in (None, "GPU", "gpu", "cuda", "CUDA"):
        assert is_gpu_medium(gpu) and medium_label(gpu) == "GPU"
    assert [medium_label(m) for m in ("CPU", "cpu_pinned", "Storage", "DISK", "EXTERNAL")] == [
        "CPU", "CPU_PINNED", "STORAGE", "DISK", "EXTERNAL"
    ]  # fmt: skip
    assert not is_gpu_medium("NVME") and medium_label("NVME") == "OTHER"


def test_first_unkeyable_block() -> None:
    assert BlockStored((1, 2), None, [], 4).first_unkeyable is None
    assert BlockStored((1, 2), None, [], 4, unkeyable_from=1).first_unkeyable == 1
    assert BlockStored((1, 2), None, [], 4, has_extra_keys=True, unkeyable_from=1).first_unkeyable == 0


def test_source_status_states() -> None:
    now = time.monotonic()
    assert source_status(False, False, False, now, None, 60)["state"] == "connecting"
    assert source_status(False, False, True, now, None, 60)["state"] == "disconnected"
    fresh = source_status(True, True, True, now - 100, now - 1, 60)
    assert fresh["state"] == "connected" and fresh["connected"] is True
    assert isinstance(fresh["state_age_seconds"], float) and fresh["state_age_seconds"] >= 100
    assert 1 <= fresh["last_event_age_seconds"] < 2  # type: ignore[operator]
    stale = source_status(True, True, True, now - 100, now - 70, 60)
    assert stale["state"] == "stale"
    assert source_status(True, True, True, now - 1, None, 60)["state"] == "connected"  # connected just now
