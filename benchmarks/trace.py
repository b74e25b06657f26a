"""The JSONL trace format shared by workload generators, the load generator and the harnesses.

One request per line (docs/benchmarks.md)::

    {"t": <arrival offset s>, "session": "<id or null>", "path": "/v1/chat/completions", "body": {...}}

Optional key written by the generators here: ``"turn"`` (0-based turn index within a session). Turn
semantics: requests of one session are sent in order (by ``turn`` when present, else by file order),
and a turn is never sent before the previous turn of its session has finished; ``t`` is the earliest
send time. Any other keys are kept in ``TraceRecord.extra`` and written back unchanged.

Reading is tolerant so any trace file works: a missing ``t`` is 0, a missing ``path`` is inferred
from the body (``messages`` → chat completions, else completions), a non-string session id is turned
into a string. Records are returned sorted by ``t`` (stable).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


@dataclass(slots=True, frozen=True)
class TraceRecord:
    """One request of a trace."""

    t: float
    path: str
    body: dict[str, Any]
    session: str | None = None
    turn: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # sent with the request (not part of the trace file)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one trace line."""
        obj: dict[str, Any] = {"t": self.t, "session": self.session, "path": self.path}
        if self.turn is not None:
            obj["turn"] = self.turn
        obj.update(self.extra)
        obj["body"] = self.body
        return obj

    @classmethod
    def from_json(cls, obj: Any, where: str = "") -> TraceRecord:
        """Parse one trace object (see the module docstring for defaults)."""
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a trace line must be a JSON object")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise TraceError(f"{where}: 'body' must be a JSON object")
        t = obj.get("t", 0.0)
        if not isinstance(t, int | float) or isinstance(t, bool) or t < 0:
            raise TraceError(f"{where}: 't' must be a non-negative number, got {t!r}")
        path = obj.get("path") or (CHAT_PATH if "messages" in body else COMPLETIONS_PATH)
        if not isinstance(path, str) or not path.startswith("/"):
            raise TraceError(f"{where}: 'path' must be an absolute path, got {path!r}")
        session = obj.get("session")
        turn = obj.get("turn")
        if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool)):
            raise TraceError(f"{where}: 'turn' must be an integer, got {turn!r}")
        extra = {k: v for k, v in obj.items() if k not in {"t", "session", "path", "body", "turn"}}
        return cls(float(t), path, body, None if session is None else str(session), turn, extra)


def write_trace(path: Path | str, records: Iterable[TraceRecord]) -> int:
    """Write ``records`` as JSONL; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: Path | str) -> list[TraceRecord]:
    """Read a JSONL trace (blank lines skipped), sorted by arrival time."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: invalid JSON: {exc}") from None
            records.append(TraceRecord.from_json(obj, where))
    records.sort(key=lambda r: r.t)
    return records
