"""The committed feed messages (picker/shared/kvfeed_pb) are what ``make protos`` makes of protos/ now."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

from picker.shared import kvfeed_pb
from picker.shared.kvfeed_pb import feed_pb2

ROOT = Path(__file__).resolve().parents[5]
COMMITTED = ROOT / "picker" / "shared" / "kvfeed_pb"


def _generator():  # protos/ is not a package: load the script by path
    spec = importlib.util.spec_from_file_location("protos_generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_descriptor_matches_the_proto(tmp_path: Path) -> None:
    """Any grpcio-tools version: the committed descriptor is the one the .proto compiles to (a .proto
    edited without ``make protos`` fails here)."""
    _generator().generate(tmp_path)
    fresh = (tmp_path / "feed_pb2.py").read_text()
    marker = "AddSerializedFile("
    committed_line = next(x for x in (COMMITTED / "feed_pb2.py").read_text().splitlines() if marker in x)
    fresh_line = next(x for x in fresh.splitlines() if marker in x)
    assert fresh_line == committed_line, "protos/ changed: run `make protos` and commit picker/shared/kvfeed_pb"


def test_generated_files_are_byte_identical(tmp_path: Path) -> None:
    """With the grpcio-tools version that generated them, every committed file is byte-identical."""
    installed = metadata.version("grpcio-tools")
    if installed != kvfeed_pb.GRPCIO_TOOLS_VERSION:
        pytest.skip(f"generated with grpcio-tools {kvfeed_pb.GRPCIO_TOOLS_VERSION}, {installed} installed")
    written = _generator().generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        p.name for p in COMMITTED.iterdir() if p.is_file() and not p.name.endswith(".pyc")
    )
    for p in written:
        assert p.read_bytes() == (COMMITTED / p.name).read_bytes(), f"{p.name} is stale: run `make protos`"


def test_messages_round_trip() -> None:
    rec = feed_pb2.FeedRecord(id=7, put=feed_pb2.Put(keys=[0, 1, 2**64 - 1], tier=feed_pb2.TIER_STORAGE_WARM))
    back = feed_pb2.FeedRecord.FromString(rec.SerializeToString())
    assert back.WhichOneof("body") == "put" and list(back.put.keys) == [0, 1, 2**64 - 1] and back.id == 7
    assert not feed_pb2.SubscribeRequest(backend="b").HasField("resume_from_id")
