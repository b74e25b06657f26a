"""The state file: every persisted source's state in one msgpack file, written atomically (tmp file, fsync,
rename), read back with every field checked. See docs/listener.md#the-state-file.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import msgpack

log = logging.getLogger("kv_listener.state")

VERSION = 1
_TMP_IDS = itertools.count()
_TMP_MIDDLE = re.compile(r"[0-9]+\.[0-9]+")  # path.<pid>.<n>.tmp


@dataclass(slots=True)
class SourceState:
    """What one source persists (and gets back at start)."""

    fingerprint: str
    last_seq: int | None
    digest: bytes | None
    events: list[bytes]
    overflow: bool = False


def write_state_file(path: str, states: dict[str, SourceState], max_bytes: int) -> tuple[int, list[str]]:
    """Write atomically (tmp + fsync + rename); returns (bytes written, sources saved without their log).
    Blocking: call it in a worker thread."""
    budget = max_bytes - 4096
    doc: dict[str, Any] = {"version": VERSION, "sources": {}}
    overflowed: list[str] = []
    for name, st in states.items():
        size = sum(len(e) + 5 for e in st.events) + 256
        keep = size <= budget and not st.overflow
        if keep:
            budget -= size
        else:
            overflowed.append(name)
        doc["sources"][name] = {
            "fingerprint": st.fingerprint,
            "last_seq": st.last_seq,
            "digest": st.digest,
            "events": st.events if keep else [],
            "overflow": not keep,
        }
    data = msgpack.packb(doc, use_bin_type=True)
    tmp = f"{path}.{os.getpid()}.{next(_TMP_IDS)}.tmp"  # one file per write: two writers never share one
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return len(data), overflowed


def remove_stale_tmp_files(path: str) -> int:
    """Delete the tmp files of writes that never finished (a crash between open and rename); returns how
    many. Call it before the first write of this process."""
    folder, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    n = 0
    for name in names:
        middle = name[len(base) + 1 : -4] if name.startswith(base + ".") and name.endswith(".tmp") else None
        if middle is not None and (middle == "" or _TMP_MIDDLE.fullmatch(middle)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
                n += 1
    return n


def read_state_file(path: str, max_bytes: int) -> dict[str, SourceState]:
    """The saved sources, or {} when there is no usable file (missing, too large, unreadable: logged)."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            log.warning("event=state_ignored path=%s reason=too_large bytes=%d", path, size)
            return {}
        with open(path, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        return {}
    except Exception as exc:
        log.warning("event=state_ignored path=%s reason=unreadable error=%s", path, type(exc).__name__)
        return {}
    out: dict[str, SourceState] = {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("sources"), dict):
        log.warning("event=state_ignored path=%s reason=bad_format", path)
        return {}
    for name, s in doc["sources"].items():
        try:
            seq = s["last_seq"]
            events = s["events"]
            ok = (
                isinstance(name, str)
                and isinstance(s["fingerprint"], str)
                and (seq is None or (isinstance(seq, int) and 0 <= seq < 1 << 64))
                and (s["digest"] is None or isinstance(s["digest"], bytes))
                and isinstance(events, list)
                and all(isinstance(e, bytes) for e in events)
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("event=state_ignored path=%s source=%s reason=bad_format", path, name)
            continue
        out[name] = SourceState(s["fingerprint"], seq, s["digest"], events, bool(s.get("overflow")))
    return out
