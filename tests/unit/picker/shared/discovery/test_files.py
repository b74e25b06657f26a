"""File discovery (picker.shared.discovery.files): the YAML file's checks, and the watcher publishing changes
and keeping the last snapshot when the file turns bad."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from picker.shared.config_files import ConfigError
from picker.shared.discovery import PoolSnapshot, make_discovery
from picker.shared.discovery import files as files_mod
from picker.shared.discovery.config import BackendsFileRef
from picker.shared.discovery.files import FileDiscovery, load_backends_file
from tests.support.poll import async_wait_until

GOOD = """\
backends:
  - name: engine-1
    address: 10.0.0.2:8000
  - name: engine-0
    address: "[fd00:0:0::7]:8001"
    annotations: {z: "1", kv-epp/events: "tcp://[fd00::7]:5557"}
"""


def write(path: Path, text: str) -> None:
    """Replace the file's content and make sure its mtime moves (coarse filesystem clocks)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns <= before:
        os.utime(path, ns=(st.st_atime_ns, before + 1_000_000))


def problems(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_backends_file(path)
    return info.value.problems


def test_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    write(path, GOOD)
    b0, b1 = load_backends_file(path)
    assert (b0.name, b0.ip, b0.port, b0.address) == ("engine-0", "fd00::7", 8001, "[fd00::7]:8001")
    assert b0.annotations == (("kv-epp/events", "tcp://[fd00::7]:5557"), ("z", "1"))
    assert (b1.name, b1.address, b1.rank, b1.annotations) == ("engine-1", "10.0.0.2:8000", 0, ())


def test_an_empty_backend_list_is_a_pool_of_none(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    write(path, "backends: []\n")
    assert load_backends_file(path) == ()


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        (
            "backends:\n  - {name: ok, address: 10.0.0.1:80}\n  - {name: .bad, address: 10.0.0.2:80}\n",
            "backends[1].name",
            "letters",
        ),
        ("backends:\n  - {name: a, address: engine.local:8000}\n", "backends[0].address", "not an IP"),
        ("backends:\n  - {name: a, address: 10.0.0.1}\n", "backends[0].address", "ip:port"),
        ("backends:\n  - {name: a, address: '::1:80'}\n", "backends[0].address", "brackets"),
        ("backends:\n  - {name: a, address: 10.0.0.1:80, weight: 2}\n", "backends[0].weight", "Extra"),
        (
            "backends:\n  - {name: a, address: 10.0.0.1:80, annotations: {k: [1]}}\n",
            "backends[0].annotations.k",
            "string",
        ),
        (
            "backends:\n  - {name: a, address: 10.0.0.1:80}\n  - {name: a, address: 10.0.0.2:80}\n",
            "backends[1].name",
            "duplicate of backends[0].name",
        ),
        (
            "backends:\n  - {name: a, address: 10.0.0.1:80}\n  - {name: b, address: 10.0.0.1:80}\n",
            "backends[1].address",
            "duplicate of backends[0].address",
        ),
        ("pool: []\n", "pool", "Extra"),
        ("", "backends", "required"),
        ("- a\n- b\n", "<root>", "mapping"),
    ],
)
def test_a_bad_file_names_the_bad_key(tmp_path: Path, text: str, where: str, says: str) -> None:
    path = tmp_path / "b.yaml"
    write(path, text)
    found = problems(path)
    assert any(p == where and says in m for p, m in found), found


def test_not_yaml_missing_and_too_big(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.yaml"
    write(path, "backends: [\n")
    [(where, message)] = problems(path)
    assert where == str(path) and "invalid YAML" in message
    [(where, message)] = problems(tmp_path / "absent.yaml")
    assert "cannot read" in message
    monkeypatch.setattr(files_mod, "MAX_FILE_BYTES", 64)
    write(path, GOOD)
    [(where, message)] = problems(path)
    assert "over the 64 bytes" in message


@contextlib.asynccontextmanager
async def watching(path: Path) -> AsyncIterator[tuple[FileDiscovery, list[PoolSnapshot]]]:
    counted: list[str] = []
    discovery = make_discovery(BackendsFileRef(path=str(path), poll_seconds=0.05), counted.append)
    assert isinstance(discovery, FileDiscovery)
    snapshots: list[PoolSnapshot] = []
    task = asyncio.create_task(discovery.run(snapshots.append))
    try:
        yield discovery, snapshots
        assert not task.done(), "run() ended by itself"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert counted.count("error") == discovery.status()["counts"].get("error", 0)  # type: ignore[attr-defined]


async def test_the_watcher_publishes_changes_and_keeps_the_last_good_file(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    write(path, GOOD)
    async with watching(path) as (discovery, snapshots):
        await async_wait_until(lambda: len(snapshots) == 1, what="first snapshot")
        assert discovery.synced and snapshots[0].names() == ("engine-0", "engine-1")
        assert snapshots[0].source == f"file {path}"

        write(path, "backends:\n  - {name: engine-2, address: 10.0.0.3:8000}\n")
        await async_wait_until(lambda: snapshots[-1].names() == ("engine-2",), what="the changed file")

        write(path, "backends:\n  - {name: engine-2, address: 10.0.0.3:8000}\n  - {name: x, adress: 1.2.3.4:5}\n")
        await async_wait_until(lambda: discovery.status()["last_error"] is not None, what="the bad file seen")
        status = discovery.status()
        assert "backends[1].adress" in str(status["last_error"]) and str(path) in str(status["last_error"])
        assert status["counts"] == {"load": 2, "error": 1} and status["backends"] == 1
        assert len(snapshots) == 2, "a bad file publishes nothing: the last snapshot stays"

        path.unlink()
        await async_wait_until(lambda: "cannot read" in str(discovery.status()["last_error"]), what="file gone")
        assert len(snapshots) == 2

        write(path, "backends:\n  - {name: engine-2, address: 10.0.0.3:8000}\n")  # same backends as published
        await async_wait_until(lambda: discovery.status()["last_error"] is None, what="good again")
        assert len(snapshots) == 2, "unchanged backends are not published again"

        write(path, "backends:\n  - {name: engine-2, address: 10.0.0.3:8000, annotations: {a: b}}\n")
        await async_wait_until(lambda: snapshots[-1].backends[0].annotation("a") == "b", what="annotations")


async def test_a_missing_file_at_start_is_not_synced_until_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "later.yaml"
    async with watching(path) as (discovery, snapshots):
        await async_wait_until(lambda: discovery.status()["last_error"] is not None, what="the error")
        assert not discovery.synced and snapshots == []
        write(path, "backends: []\n")
        await async_wait_until(lambda: discovery.synced, what="synced")
        assert len(snapshots) == 1 and snapshots[0].backends == ()
