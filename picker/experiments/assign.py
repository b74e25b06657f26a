"""Which arm a request belongs to: its session's key (a session header, else the conversation's first turn), a
stable hash of that key and the experiment's salt, and the arms' weights. Pure and deterministic: every picker
replica, before and after a restart, puts a session in the same arm. Also the sessions' turn table (turn index,
``start_gap_s``, ``idle_gap_s``). See docs/experiments.md, "Arms and assignment".
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from itertools import accumulate

from picker.facts import RequestFacts

SOURCE_HEADER = "header"
SOURCE_FIRST_TURN = "first_turn"
SOURCE_NONE = "none"  # no header, no text: the request is its own session (a random key)
_PERSON = b"kv-epp-session"


@dataclass(slots=True, frozen=True)
class SessionKey:
    """A session's identity: ``digest`` (16 bytes, what the assignment hashes), ``id`` (its first 8 bytes in
    hex: what the decision log records, never the raw header or text) and where it came from."""

    digest: bytes
    source: str

    @property
    def id(self) -> str:
        return self.digest[:8].hex()


def session_of(headers: Mapping[str, str], facts: RequestFacts, header_names: Sequence[str]) -> SessionKey:
    """The first of ``header_names`` the request carries (its value is the session: the same id under two of
    the names is one session), else the conversation's first turn (the system prompt and the first non-system
    message, or a completion's prompt: every turn of a conversation repeats them), else a random key."""
    for name in header_names:
        value = headers.get(name)
        if value:
            return SessionKey(_digest(b"h", value.encode("utf-8", "surrogatepass")), SOURCE_HEADER)
    if facts.system or facts.first_message:
        text = f"{facts.system or ''}\x00{facts.first_message or ''}".encode("utf-8", "surrogatepass")
        return SessionKey(_digest(b"t", text), SOURCE_FIRST_TURN)
    if facts.prompt_token_ids:
        ids = b",".join(str(i).encode() for i in facts.prompt_token_ids)
        return SessionKey(_digest(b"t", ids), SOURCE_FIRST_TURN)
    return SessionKey(os.urandom(16), SOURCE_NONE)


def _digest(kind: bytes, data: bytes) -> bytes:
    h = blake2b(kind + b"\x00", digest_size=16, person=_PERSON)
    h.update(data)
    return h.digest()


class Assigner:
    """Arms by weight over the unit interval (arms in name order), a session's point in it from its digest and
    the salt."""

    def __init__(self, salt: str, weights: Mapping[str, float]) -> None:
        self.names = tuple(sorted(weights))
        total = sum(weights[n] for n in self.names)
        self._bounds = [w / total for w in accumulate(weights[n] for n in self.names)][:-1]
        self._key = blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=32).digest()

    def point(self, digest: bytes) -> float:
        """The session's point in [0, 1): a keyed hash of its digest, the same in every process."""
        return int.from_bytes(blake2b(digest, digest_size=8, key=self._key).digest(), "big") / 2.0**64

    def arm(self, digest: bytes) -> str:
        return self.names[bisect_right(self._bounds, self.point(digest))]


@dataclass(slots=True)
class _Turns:
    turn: int
    last_start: float
    last_end: float | None  # None while the last request has not ended (or did not complete)
    open: int  # requests of the session in flight now


class SessionTurns:
    """Per session, as this picker sees it: the turn index and the two gaps of the seed (``start_gap_s``: from
    the previous request's start; ``idle_gap_s``: from the previous request's end, only when it completed and
    nothing of the session is in flight: parallel or unfinished requests get none). Bound: ``max_sessions``,
    least recently seen dropped (a dropped session starts again at turn 1)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._table: OrderedDict[bytes, _Turns] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def begin(self, digest: bytes, now: float) -> tuple[int, float | None, float | None]:
        """A request of the session starts: (turn, start_gap_s, idle_gap_s); turn 1 is a session new to this
        picker."""
        t = self._table.get(digest)
        if t is None:
            self._table[digest] = _Turns(1, now, None, 1)
            while len(self._table) > self.max_sessions:
                self._table.popitem(last=False)
            return 1, None, None
        self._table.move_to_end(digest)
        start_gap = now - t.last_start
        idle_gap = now - t.last_end if t.last_end is not None and t.open == 0 else None
        t.turn += 1
        t.last_start = now
        t.last_end = None
        t.open += 1
        return t.turn, start_gap, idle_gap

    def end(self, digest: bytes, now: float, completed: bool) -> None:
        t = self._table.get(digest)
        if t is None:
            return
        t.open = max(0, t.open - 1)
        t.last_end = now if completed and t.open == 0 else None
