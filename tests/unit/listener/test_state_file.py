"""listener.state_file: the state file round-trips every source, a source that does not fit is saved without its
log, every write goes through a tmp file of its own, and a file that is not usable is ignored (whole or per
source), never trusted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from listener import state_file
from listener.state_file import SourceState, read_state_file, remove_stale_tmp_files, write_state_file


def test_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "state.bin")
    states = {
        "e1": SourceState("vllm|tcp://a:1||m", 41, b"d" * 16, [b"\x91\x01", b"\x91\x02"]),
        "e2": SourceState("sglang|tcp://b:1||m", None, None, []),
    }
    size, overflowed = write_state_file(path, states, 1 << 20)
    assert overflowed == [] and size == Path(path).stat().st_size
    assert read_state_file(path, 1 << 20) == states
    assert Path(path).stat().st_mode & 0o777 == 0o600


def test_a_source_that_does_not_fit_is_saved_without_its_log(tmp_path: Path) -> None:
    path = str(tmp_path / "state.bin")
    big = [b"x" * 1000] * 70  # ~70 KiB of events: more than a 64 KiB file holds
    small = [b"y" * 10]
    states = {"big": SourceState("f", 1, b"d", big), "small": SourceState("f", 2, b"d", small)}
    _, overflowed = write_state_file(path, states, 1 << 16)
    assert overflowed == ["big"]
    back = read_state_file(path, 1 << 16)
    assert back["big"].events == [] and back["big"].overflow and back["big"].last_seq == 1
    assert back["small"].events == small and not back["small"].overflow
    # a log that overflowed in memory is saved without events too, whatever room is left
    _, overflowed = write_state_file(path, {"s": SourceState("f", 3, b"d", small, overflow=True)}, 1 << 20)
    assert overflowed == ["s"] and read_state_file(path, 1 << 20)["s"].events == []


def test_each_write_uses_its_own_tmp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = state_file.os.open

    def spy(path: str, *args: Any) -> int:
        opened.append(path)
        return real_open(path, *args)

    monkeypatch.setattr(state_file.os, "open", spy)
    path = str(tmp_path / "state.bin")
    st = {"e1": SourceState("f", 1, b"d", [])}
    write_state_file(path, st, 1 << 20)
    write_state_file(path, st, 1 << 20)
    tmps = [p for p in opened if p.startswith(path + ".")]
    assert len(tmps) == 2 and tmps[0] != tmps[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


def test_only_tmp_files_of_unfinished_writes_are_removed(tmp_path: Path) -> None:
    for name in ("state.bin.tmp", "state.bin.123.4.tmp", "state.bin.x.tmp", "other.bin.1.2.tmp", "state.bin"):
        (tmp_path / name).write_bytes(b"")
    assert remove_stale_tmp_files(str(tmp_path / "state.bin")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.bin.1.2.tmp", "state.bin", "state.bin.x.tmp"]
    assert remove_stale_tmp_files(str(tmp_path / "missing" / "state.bin")) == 0


def entry(**kw: Any) -> dict[str, Any]:
    return {"fingerprint": "f", "last_seq": 1, "digest": b"d", "events": [b"e"], "overflow": False, **kw}


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 2, "sources": {}},
        {"version": 1, "sources": []},
        [1, 2],
    ],
)
def test_a_file_of_another_version_or_shape_is_ignored(tmp_path: Path, doc: Any) -> None:
    path = tmp_path / "state.bin"
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    assert read_state_file(str(path), 1 << 20) == {}


def test_unreadable_too_large_or_missing_files_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    assert read_state_file(str(path), 1 << 20) == {}
    path.write_bytes(b"\xc1\xc1")
    assert read_state_file(str(path), 1 << 20) == {}
    write_state_file(str(path), {"e1": SourceState("f", 1, b"d", [b"e" * 500])}, 1 << 20)
    assert read_state_file(str(path), 100) == {}  # larger than max_bytes: not even read


def test_a_bad_source_entry_is_skipped_alone(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    sources = {
        "ok": entry(),
        "bad-seq": entry(last_seq=-1),
        "text-seq": entry(last_seq="1"),
        "bad-digest": entry(digest="text"),
        "bad-events": entry(events=["text"]),
        "no-fingerprint": {"last_seq": 1, "digest": None, "events": []},
    }
    path.write_bytes(msgpack.packb({"version": 1, "sources": sources}, use_bin_type=True))
    assert list(read_state_file(str(path), 1 << 20)) == ["ok"]
