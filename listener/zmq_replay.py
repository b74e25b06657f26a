"""The replay client of a ZMQ source: asks the engine's replay ROUTER for its buffered batches from a seq and
yields them, whatever reply layout the engine uses. How a source uses the replies (catch-up, incarnation checks)
is in ``listener.zmq_source``; the layouts and bounds are in docs/listener.md#replay.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import zmq as _zmq
import zmq.asyncio

from listener.config import LimitsConfig, SourceConfig
from listener.zmq_receiver import ipv6

log = logging.getLogger("kv_listener.zmq")
Z: Any = _zmq  # pyzmq is typed Any (see listener.zmq_receiver)

END_SEQ = b"\xff" * 8
MAX_REPLAY_MESSAGES = 100_000  # one replay applies at most this many batches


class ReplayEnd(Exception):
    """The replay stream ended: ``args[0]`` is end, timeout, error or limit."""


def split_replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq8, payload) from any accepted replay reply layout, or None when it is not one."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:  # [b"", seq, payload] or [topic, seq, payload]: seq is always frame 1
        return frames[1], frames[2]
    if len(frames) == 2:
        return frames[0], frames[1]
    return None


async def replay(
    ctx: zmq.asyncio.Context,
    cfg: SourceConfig,
    limits: LimitsConfig,
    start: int,
    on_malformed: Callable[[], None],
) -> AsyncGenerator[tuple[int, bytes], None]:
    """(seq, payload) replies of ``cfg.replay_endpoint`` from ``start``; ends with ``ReplayEnd(status)``.
    A malformed reply calls ``on_malformed`` and ends the stream (``error``)."""
    assert cfg.replay_endpoint
    dealer = ctx.socket(Z.DEALER)
    dealer.setsockopt(Z.LINGER, 0)
    if ipv6(cfg.replay_endpoint):
        dealer.setsockopt(Z.IPV6, 1)
    dealer.setsockopt(Z.MAXMSGSIZE, limits.max_message_bytes)
    timeout_ms = cfg.replay_timeout_ms
    try:
        dealer.connect(cfg.replay_endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        for _ in range(MAX_REPLAY_MESSAGES):
            if not await dealer.poll(timeout_ms, Z.POLLIN):
                raise ReplayEnd("timeout")
            reply = split_replay_reply(list(await dealer.recv_multipart()))
            if reply is None or len(reply[0]) != 8:
                on_malformed()
                raise ReplayEnd("error")
            if reply[0] == END_SEQ:
                raise ReplayEnd("end")
            yield int.from_bytes(reply[0], "big"), reply[1]
        raise ReplayEnd("limit")
    except Z.ZMQError as exc:
        log.warning("event=replay_failed source=%s error=%s", cfg.backend_name, exc)
        raise ReplayEnd("error") from None
    finally:
        dealer.close(linger=0)
