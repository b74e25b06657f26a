"""The decision log's writer: JSON lines, rotation, the bounded queue and write errors."""

from __future__ import annotations

import json
from pathlib import Path

from picker.experiments.decision_log import DecisionLog


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_records_are_written_as_json_lines_and_flushed_at_close(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(path), 1 << 20, 2, 100)
    for i in range(10):
        log.write({"session": f"s{i}", "arm": "a", "usage": {"cached_tokens": None}})
    assert log.close()
    got = lines(path)
    assert [r["session"] for r in got] == [f"s{i}" for i in range(10)]
    assert got[0]["usage"] == {"cached_tokens": None}  # unknown stays null
    assert log.stats()["written"] == 10 and log.stats()["dropped"] == 0


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    log = DecisionLog(str(path), 1 << 20, 2, 3, start=False)  # the writer not started: nothing drains
    for i in range(5):
        log.write({"i": i})
    assert log.queued == 3 and log.dropped == 2
    log.start()
    assert log.close()
    assert [r["i"] for r in lines(path)] == [0, 1, 2]


def test_rotation_keeps_the_configured_backups(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    record = {"pad": "x" * 1000}
    for _ in range(6):  # one writer per batch of 5 records (~5 KB): each batch rotates the 4 KiB file
        log = DecisionLog(str(path), 4096, 2, 100, start=False)
        for _ in range(5):
            log.write(record)
        log.start()
        log.close()
    assert path.exists() and (tmp_path / "d.jsonl.1").exists() and (tmp_path / "d.jsonl.2").exists()
    assert not (tmp_path / "d.jsonl.3").exists()
    assert len(lines(path)) == 5


def test_a_write_error_loses_the_batch_counted_and_never_raises(tmp_path: Path) -> None:
    log = DecisionLog(str(tmp_path / "missing-dir" / "d.jsonl"), 4096, 1, 10, start=False)
    log.write({"a": 1})
    log.write({"a": 2})
    log.start()
    assert log.close()
    s = log.stats()
    assert s["written"] == 0 and s["dropped"] == 2 and s["errors"] == 1


def test_nothing_is_queued_after_close(tmp_path: Path) -> None:
    log = DecisionLog(str(tmp_path / "d.jsonl"), 4096, 1, 10)
    assert log.close()
    log.write({"late": True})
    assert log.dropped == 1 and log.queued == 0
