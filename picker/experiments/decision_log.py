"""The decision log: one JSON line per request of an experiment, written off the event loop.

The request path hands a finished record to ``DecisionLog.write`` (it serializes it, a few microseconds, and
queues the bytes); a writer thread drains the queue to ``stdout`` or to a file rotated at ``max_bytes``
(``path.1`` … ``path.N``, the oldest dropped). Bound: ``queue_max`` records wait for the writer; beyond that a
record is dropped and counted (``dropped``), never blocking the request path. A write error (a full disk) is
counted and logged once per run of errors; the records of that batch are lost and counted with the dropped.
See docs/experiments.md, "The decision log".
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

import orjson

log = logging.getLogger("kv_epp.experiments")

STDOUT = "stdout"
FLUSH_SECONDS = 1.0  # the writer wakes at least this often (a record waits at most about this long)


class DecisionLog:
    """A bounded queue of JSON lines and the thread that writes them (see the module docstring)."""

    def __init__(
        self,
        target: str,
        max_bytes: int,
        backups: int,
        queue_max: int,
        start: bool = True,
        after: DecisionLog | None = None,
    ) -> None:
        self.target = target
        self.max_bytes = max_bytes
        self.backups = backups
        self.queue_max = queue_max
        self.written = 0
        self.dropped = 0
        self.lost = 0  # records of batches a write error lost (the writer thread's count; ``dropped`` is the loop's)
        self.errors = 0
        self.rotations = 0
        self._queue: deque[bytes] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._file: BinaryIO | None = None
        self._size = 0
        self._failing = False
        self._after = after  # a closed writer (a reload): this one writes once that one has finished
        self._thread = threading.Thread(target=self._run, name="kv-epp-decision-log", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the writer (``start=False`` at construction: the records queue until then)."""
        self._thread.start()

    def same(self, target: str, max_bytes: int, backups: int, queue_max: int) -> bool:
        return (self.target, self.max_bytes, self.backups, self.queue_max) == (target, max_bytes, backups, queue_max)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (the event loop's side: no I/O). Dropped and counted when the queue is full."""
        if self._closing or len(self._queue) >= self.queue_max:
            self.dropped += 1
            return
        self._queue.append(orjson.dumps(record) + b"\n")
        if len(self._queue) == 1:
            self._wake.set()

    def close(self, timeout: float = 3.0, wait: bool = True) -> bool:
        """Take no more records; the thread writes what is queued, closes the file and ends. With ``wait``, wait
        for it (at most ``timeout``): True when it has ended."""
        self._closing = True
        self._wake.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        after, self._after = self._after, None
        if after is not None:
            after.join()  # the previous writer (same file, maybe) finishes its queue first
        try:
            while True:
                self._wake.wait(FLUSH_SECONDS)
                self._wake.clear()
                self._drain()
                if self._closing:
                    self._drain()
                    return
        finally:
            if self._file is not None and self.target != STDOUT:
                try:
                    self._file.close()
                except OSError:
                    pass

    def _drain(self) -> None:
        batch: list[bytes] = []
        q = self._queue
        while q:
            batch.append(q.popleft())
            if len(batch) >= 1024:
                self._write_batch(batch)
                batch = []
        if batch:
            self._write_batch(batch)

    def _write_batch(self, batch: list[bytes]) -> None:
        data = b"".join(batch)
        try:
            f = self._open()
            if self.target != STDOUT and self._size and self._size + len(data) > self.max_bytes:
                f = self._rotate()
            f.write(data)
            f.flush()
            self._size += len(data)
            self.written += len(batch)
            if self._failing:
                self._failing = False
                log.info("event=decision_log_recovered target=%s", self.target)
        except OSError as exc:
            self.errors += 1
            self.lost += len(batch)
            if not self._failing:
                self._failing = True
                log.error("event=decision_log_write_failed target=%s error=%r", self.target, str(exc))
            self._close_file()

    def _open(self) -> BinaryIO:
        if self._file is None:
            if self.target == STDOUT:
                self._file = sys.stdout.buffer
            else:
                path = Path(self.target)
                self._file = path.open("ab")
                self._size = path.stat().st_size
        return self._file

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None and self.target != STDOUT:
            try:
                f.close()
            except OSError:
                pass

    def _rotate(self) -> BinaryIO:
        """``path`` → ``path.1`` → … → ``path.<backups>`` (the oldest removed), then a new ``path``."""
        self._close_file()
        base = self.target
        if self.backups == 0:
            os.remove(base)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{base}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{base}.{i + 1}")
            os.replace(base, f"{base}.1")
        self.rotations += 1
        self._size = 0
        return self._open()

    def stats(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "written": self.written,
            "dropped": self.dropped + self.lost,
            "errors": self.errors,
            "rotations": self.rotations,
            "queued": len(self._queue),
            "queue_max": self.queue_max,
            "max_bytes": self.max_bytes,
            "backups": self.backups,
        }
