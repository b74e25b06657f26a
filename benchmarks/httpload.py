"""A small closed-loop HTTP/1.1 load generator on raw asyncio streams (keep-alive, N connections).

Lighter than an HTTP client library, so more of the machine's two cores go to what is measured.
Each connection sends one request at a time and reads the full response (Content-Length or chunked).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    requests: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    completed_total: int = 0  # every answered request, warm-up included (CPU per request divides by it)
    # SSE events (``data: ...`` blocks) that arrived within the measured window, whenever their request
    # started: a time-based rate, not quantized by long streams starting or ending at the window's edges
    chunks: int = 0
    events_total: int = 0  # SSE events of every answered request, warm-up included
    ttfb_ms: list[float] = field(default_factory=list)  # first response byte, measured window

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds if self.seconds else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def body_framing(head: bytes) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked?) of an HTTP/1.1 message from its head (start line + headers)."""
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            length = int(v.strip())
        elif k == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    return length, chunked


async def _read_response(reader: asyncio.StreamReader, sse: list[float] | None = None) -> int:
    """Read one response; return its status. With ``sse`` (a list ``[count, first_byte, window_start,
    window_end, total]``), count its SSE events (blank-line terminated blocks, whatever the HTTP chunking):
    those that arrive within the window into ``sse[0]``, all into ``sse[4]``; the first byte's time goes
    to ``sse[1]``."""
    head = await reader.readuntil(b"\r\n\r\n")
    if sse is not None:
        sse[1] = time.perf_counter()
    status = int(head.split(b" ", 2)[1])
    length, chunked = body_framing(head)
    if chunked:
        tail = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            if sse is not None:  # an event may straddle HTTP chunks: keep the previous chunk's last byte
                n = (tail + data[:-2]).count(b"\n\n")
                sse[4] += n
                if sse[2] <= time.perf_counter() < sse[3]:
                    sse[0] += n
                tail = data[-3:-2]
    elif length:
        await reader.readexactly(length)
    return status


async def _worker(
    host: str, port: int, requests: list[bytes], offset: int, stop_at: float, result: LoadResult, warmup_until: float,
    sse: bool = False,
) -> None:  # fmt: skip
    reader, writer = await asyncio.open_connection(host, port)
    i = offset
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            writer.write(requests[i % len(requests)])
            i += 1
            events = [0.0, t0, warmup_until, stop_at, 0.0] if sse else None
            try:
                status = await _read_response(reader, events)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                result.errors += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            t1 = time.perf_counter()
            result.completed_total += 1
            if t0 >= warmup_until:
                result.requests += 1
                result.statuses[status] = result.statuses.get(status, 0) + 1
                result.latencies_ms.append((t1 - t0) * 1000.0)
                if events is not None:
                    result.ttfb_ms.append((events[1] - t0) * 1000.0)
            if events is not None:
                result.chunks += int(events[0])
                result.events_total += int(events[4])
    finally:
        writer.close()


def build_request(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    hdrs = {"Host": "bench", "Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    return head.encode() + body


async def run_load(
    host: str, port: int, path: str, bodies: list[bytes], *, concurrency: int, seconds: float, warmup: float = 1.0,
    headers: dict[str, str] | None = None, sse: bool = False,
) -> LoadResult:  # fmt: skip
    """Closed-loop load for ``seconds`` (after ``warmup``) with ``concurrency`` connections; the
    request bodies rotate (each connection starts at a different one). ``sse``: count the SSE events of
    (chunked) responses and the time to the first response byte. A request started before the end is
    read to its end (``completed_total`` then covers all the work done during the call)."""
    requests = [build_request(path, b, headers) for b in bodies]
    result = LoadResult()
    start = time.perf_counter()
    warmup_until = start + warmup
    stop_at = warmup_until + seconds
    await asyncio.gather(
        *(_worker(host, port, requests, i * 7, stop_at, result, warmup_until, sse) for i in range(concurrency))
    )
    result.seconds = seconds
    return result
