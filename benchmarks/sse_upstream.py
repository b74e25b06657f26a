"""A minimal OpenAI-shaped upstream for the overhead harness's streaming row: raw asyncio HTTP/1.1.

A request whose body says ``"stream": true`` gets ``--tokens`` SSE chunks (one token each, each written
with its own ``write``, with an optional gap between them), then a final chunk with ``finish_reason`` and
``usage`` (``prompt_tokens_details.cached_tokens`` included) and ``data: [DONE]``. Any other request gets
one JSON completion with the same usage, Content-Length framed. The request body is always read in full
before answering, so every client connection is kept alive and reused.

Why not the engine simulator: its tokenizer, prefix cache and batching model cost CPU per request on
the same two cores as Envoy and the picker, and its step pacing sets the token rate; here the token rate
is bounded only by the proxies under test, and the upstream's cost is the same for every path.

Run: python -m benchmarks.sse_upstream [--port 0] [--tokens 256] [--gap-ms 0]
Prints ``sse-upstream ready port=PORT`` once it listens (on 0.0.0.0, so 127.0.0.N all reach it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

from benchmarks.httpload import body_framing

READY_PREFIX = "sse-upstream ready"
_HEAD_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2},
    }


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The request body, Content-Length or chunked (Envoy forwards a body whose length it does not know,
    e.g. one an ext_proc server streamed back, chunked)."""
    length, chunked = body_framing(head)
    if not chunked:
        return await reader.readexactly(length) if length else b""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers expected: the blank line
            return b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])


class Upstream:
    def __init__(self, tokens: int, gap_s: float) -> None:
        self.tokens = tokens
        self.gap_s = gap_s
        base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench-model"}
        # Pre-framed HTTP chunks: the upstream does no per-token work beyond the write.
        self.token_chunks = [
            _http_chunk(
                _event({**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})
            )
            for i in range(tokens)
        ]
        self.base = base

    def _tail(self, prompt_tokens: int) -> bytes:
        last = {
            **self.base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": _usage(prompt_tokens, self.tokens),
        }
        return _http_chunk(_event(last)) + _http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def _full(self, prompt_tokens: int) -> bytes:
        body = json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 0,
                "model": "bench-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": _usage(prompt_tokens, 1),
            },
            separators=(",", ":"),
        ).encode()
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = await _read_body(reader, head)
                prompt_tokens = max(1, len(body) // 4)
                if b'"stream": true' in body or b'"stream":true' in body:
                    writer.write(_HEAD_SSE)
                    for chunk in self.token_chunks:
                        writer.write(chunk)  # one write (one send) per token, as an engine emits them
                        await writer.drain()
                        if self.gap_s > 0:
                            await asyncio.sleep(self.gap_s)
                        else:
                            await asyncio.sleep(0)  # let the other streams write: no coalescing by design
                    writer.write(self._tail(prompt_tokens))
                else:
                    writer.write(self._full(prompt_tokens))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


async def serve(port: int, tokens: int, gap_ms: float) -> None:
    up = Upstream(tokens, gap_ms / 1000.0)
    server = await asyncio.start_server(up.handle, "0.0.0.0", port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"{READY_PREFIX} port={bound}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=256, help="SSE token chunks per streamed response")
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause between token chunks (0: as fast as read)")
    a = p.parse_args()
    asyncio.run(serve(a.port, a.tokens, a.gap_ms))


if __name__ == "__main__":
    main()
