"""A tiny OpenAI-shaped upstream for picker tests: answers with its own name, can stream, fail or stall.

Its answers are finished ones, as an engine's (the response cache stores only those): a JSON answer carries one
choice with ``finish_reason: stop`` (on ``/v1/messages`` also ``stop_reason: end_turn``), a stream's last token
chunk ``finish_reason: length`` (as vLLM's last chunk when ``max_tokens`` ran out), the chunks before it null.

Run: python -m tests.support.echo_backend --ports 8001,8002 | --count N [--names a,b]
Once every port listens it prints ``echo-backend ready ports=P1,P2,...`` on stdout.
Control (per port): POST /control {"fail": true|false, "delay_ms": N, "hang": true|false}. With ``hang`` every
request but /control and /stats is read and never answered (a replica that accepts connections and hangs:
its health and metrics routes too) until ``hang`` is false; ``hung`` counts the API requests it held.
``hold`` is finer: with ``{"hold": true}`` each API request is read and then held on its own, until
``{"release": N}`` answers the N held longest (``{"release": -1}``: all of them) or ``hold`` is false (all).
``arrivals`` lists, in arrival order, the ``x-test-tag`` header of every API request that reached it;
``held`` those still held (a held request whose client went away leaves it); ``reset`` clears both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections import deque

from aiohttp import web


def make_app(name: str) -> web.Application:
    state = {
        "fail": False, "delay_ms": 0, "active": 0, "seen": 0, "max_active": 0, "hang": False, "hung": 0,
        "hold": False, "arrivals": [], "held": [],
    }  # fmt: skip
    answering = asyncio.Event()
    answering.set()
    holding: deque[tuple[str, asyncio.Future[None]]] = deque()  # held requests, longest held first

    def release(n: int) -> None:
        while holding and n != 0:
            tag, fut = holding.popleft()
            state["held"].remove(tag)
            if not fut.done():
                fut.set_result(None)
            n -= 1

    async def control(request: web.Request) -> web.Response:
        data = await request.json()
        state.update({k: v for k, v in data.items() if k in ("fail", "delay_ms", "hang", "hold")})
        if data.get("reset"):
            state.update(seen=0, max_active=0, hung=0, arrivals=[])
        if state["hang"]:
            answering.clear()
        else:
            answering.set()
        if not state["hold"]:
            release(-1)
        elif "release" in data:
            release(int(data["release"]))
        return web.json_response(state)

    @web.middleware
    async def hang(request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        if not answering.is_set() and request.path not in ("/control", "/stats"):
            if request.path.startswith("/v1/"):
                state["hung"] += 1
            await answering.wait()
        return await handler(request)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"name": name, **state})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state["seen"] += 1
        tag = request.headers.get("x-test-tag", "")
        state["arrivals"].append(tag)
        if state["hold"]:
            entry: tuple[str, asyncio.Future[None]] = (tag, asyncio.get_running_loop().create_future())
            holding.append(entry)
            state["held"].append(tag)
            try:
                await entry[1]
            finally:
                if entry in holding:  # the client went away while held
                    holding.remove(entry)
                    state["held"].remove(tag)
        state["active"] += 1
        state["max_active"] = max(state["max_active"], state["active"])
        try:
            if state["delay_ms"]:
                await asyncio.sleep(state["delay_ms"] / 1000)
            if state["fail"]:
                return web.json_response({"error": "injected failure", "backend": name}, status=500)
            try:
                data = json.loads(body)
            except ValueError:
                return web.json_response({"error": "backend got invalid JSON", "backend": name}, status=422)
            headers = {"x-backend": name, "x-body-bytes": str(len(body))}
            dest = request.headers.get("x-gateway-destination-endpoint", "")
            headers["x-seen-destination"] = dest
            # P/D (docs/pd.md): what reached the upstream of llm-d's prefill header, every value ("<absent>": none)
            headers["x-seen-prefiller"] = ",".join(request.headers.getall("x-prefiller-host-port", [])) or "<absent>"
            if data.get("stream"):
                resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
                await resp.prepare(request)
                n = int(data.get("max_tokens") or 5)
                for i in range(n):
                    choice = {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}
                    if i == n - 1:
                        choice["finish_reason"] = "length"
                    chunk = {"backend": name, "index": i, "choices": [choice]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            answer = {"backend": name, "body_bytes": len(body), "echo_model": data.get("model")}
            answer["choices"] = [
                {"index": 0, "message": {"role": "assistant", "content": name}, "finish_reason": "stop"}
            ]
            if request.path == "/v1/messages":
                answer.update(type="message", stop_reason="end_turn", content=[{"type": "text", "text": name}])
            return web.json_response(answer, headers=headers)
        finally:
            state["active"] -= 1

    app = web.Application(client_max_size=64 << 20, middlewares=[hang])
    app.add_routes(
        [
            web.post("/control", control),
            web.get("/stats", stats),
            web.post("/v1/chat/completions", completions),
            web.post("/v1/completions", completions),
            web.post("/v1/messages", completions),
            web.get("/v1/models", stats),
        ]
    )
    return app


READY_PREFIX = "echo-backend ready"


async def serve(ports: list[int], names: list[str]) -> None:
    runners = []
    bound = []
    for port, name in zip(ports, names, strict=True):
        runner = web.AppRunner(make_app(name), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # port 0: any free port, reported on the ready line
        bound.append(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
        runners.append(runner)
    print(f"{READY_PREFIX} ports={','.join(map(str, bound))}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", help="comma-separated ports (0: any free port)")
    p.add_argument("--count", type=int, help="this many backends on free ports (instead of --ports)")
    p.add_argument("--names")
    a = p.parse_args()
    if (a.ports is None) == (a.count is None):
        p.error("give exactly one of --ports and --count")
    ports = [int(x) for x in a.ports.split(",")] if a.ports else [0] * a.count
    names = a.names.split(",") if a.names else [f"be-{i}" for i in range(len(ports))]
    asyncio.run(serve(ports, names))


if __name__ == "__main__":
    main()
