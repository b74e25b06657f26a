"""listener.zmq_replay against a replay ROUTER on loopback: every reply layout, the end marker, a silent or a
malformed engine, the bound on one replay.

The tests that start a server or bind a socket: tests/integration/test_listener_zmq_replay.py."""

from __future__ import annotations

from listener.zmq_replay import split_replay_reply
from tests.support.fake_engines import seq8


def test_split_replay_reply_layouts() -> None:
    s, p = seq8(3), b"payload"
    for frames in ([b"", s, p], [b"topic", s, p], [s, p], [b"", b"", s, p], [b"", b"topic", s, p]):
        assert split_replay_reply(frames) == (s, p), frames
    assert split_replay_reply([s]) is None and split_replay_reply([b"a", b"b", b"c", b"d", b"e"]) is None
