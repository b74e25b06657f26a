"""Admission control through the real Envoy, both body modes: 50 clients each stall an 8 MiB upload.

The picker's RSS stays under its baseline + ``admission.max_buffered_body_bytes`` + RSS_OVERHEAD; while
the stalled uploads hold the body budget a new request gets 429 with ``Retry-After`` and a JSON error;
once the stalled clients are gone (their connections closed, Envoy resets the streams) new requests are
routed again. No timing assertion: every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, build_stack, http
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

MiB = 1 << 20
BUDGET = 32 * MiB  # admission.max_buffered_body_bytes: four declared 8 MiB bodies fill it
UPLOAD = 8 * MiB  # declared Content-Length of each stalled upload (= extproc.max_body_bytes)
SENT = 6 * MiB  # bytes each stalled client sends before it stops
CLIENTS = 50
# Above the buffered bytes: gRPC core's HTTP/2 receive buffers (body bytes Envoy sent before the 429 reached
# it: outside the picker's accounting), transient copies of large messages, the allocator's slack and
# per-stream objects. With BDP probing off in the server options (the window stays small) the growth over
# the budget measured 25-43 MiB in full duplex with 50 clients (74-190 MiB with probing on), ~0 in
# BUFFERED mode (Envoy holds the bodies).
RSS_OVERHEAD = 96 * MiB
CONFIG = {
    "selection_strategy": "RoundRobin",
    "extproc": {"max_body_bytes": UPLOAD},
    "admission": {"max_buffered_body_bytes": BUDGET, "max_open_streams": 256, "retry_after_seconds": 2},
}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    yield from build_stack(workdir, request.param, 2, CONFIG)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def overloaded_count(stack: Stack) -> float:
    with urllib.request.urlopen(stack.picker.admin_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('continuum_picker_requests_total{outcome="overloaded"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


class StalledUpload:
    """A client that declares an 8 MiB body, sends SENT bytes of it (or until refused) and stops."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sent = 0
        self.answer = b""
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                f"Content-Length: {UPLOAD}\r\n\r\n"
            ).encode()
            self.sock.sendall(head + b'{"model":"m","messages":[{"role":"user","content":"')
            chunk = b"x" * (256 << 10)
            self.sock.settimeout(0.5)
            while self.sent < SENT:
                try:
                    self.sock.sendall(chunk)
                    self.sent += len(chunk)
                except TimeoutError:  # back-pressure: the proxy stopped reading (a refused upload, or full)
                    if self._read_answer():
                        break
        except OSError:
            pass  # refused: the proxy answered and closed
        try:
            self._read_answer(2.0)  # a refused upload has its answer by now; a stalled one has none
        finally:
            self.finished.set()

    def _read_answer(self, timeout: float = 0.5) -> bool:
        try:
            self.sock.settimeout(timeout)
            data = self.sock.recv(65536)
        except OSError:
            return False
        self.answer += data
        return bool(data)

    @property
    def status(self) -> int | None:
        if not self.answer.startswith(b"HTTP/1.1 "):
            return None
        return int(self.answer[9:12])

    def close(self) -> None:
        self.sock.close()
        self.thread.join(30)


def test_stalled_uploads_are_bounded_and_new_requests_429_until_they_are_gone(stack: Stack) -> None:
    pid = stack.picker.process.proc.pid
    small = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert http("POST", stack.url + "/v1/chat/completions", small).status == 200
    baseline = rss(pid)
    before = overloaded_count(stack)
    clients = [StalledUpload(stack.envoy.opts.listen_port) for _ in range(CLIENTS)]
    try:
        # 4 declared bodies fill the 32 MiB budget; the other 46 are refused at their headers
        wait_until(lambda: overloaded_count(stack) - before >= CLIENTS - BUDGET // UPLOAD, 120, 0.2,
                   "the uploads past the budget refused")  # fmt: skip
        wait_until(lambda: all(c.finished.is_set() for c in clients), 120, 0.2, "every client sent or was refused")
        peak = rss(pid)
        refused = [c for c in clients if c.status is not None]
        assert len(refused) >= CLIENTS - BUDGET // UPLOAD
        for c in refused:
            assert c.status == 429 and b"retry-after: 2" in c.answer.lower()
        # while saturated: a new request is refused at once, with Retry-After and a JSON error
        r = http("POST", stack.url + "/v1/chat/completions", small)
        assert r.status == 429 and r.headers.get("retry-after") == "2"
        assert r.json()["error"]["code"] == "overloaded"
        peak = max(peak, rss(pid))
        assert peak <= baseline + BUDGET + RSS_OVERHEAD, (peak / MiB, baseline / MiB)
    finally:
        for c in clients:
            c.close()
    # the stalled uploads are gone: their streams closed and the budget came back
    wait_until(lambda: http("POST", stack.url + "/v1/chat/completions", small).status == 200, 60, 0.2,
               "a request routed after the stalled uploads are gone")  # fmt: skip
    r = http("POST", stack.url + "/v1/chat/completions", small)
    assert r.status == 200 and json.loads(r.body)["echo_model"] == "m"
