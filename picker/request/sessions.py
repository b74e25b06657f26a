"""Session affinity's table: session key → endpoint name, read by the prepare stage, written at commit."""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    """session key -> endpoint name. Bound: ``max_sessions`` entries of 16-byte keys, LRU, TTL on read."""

    def __init__(self, max_sessions: int, ttl_seconds: float) -> None:
        self.max_sessions = max_sessions
        self.ttl = ttl_seconds
        self._map: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def get(self, session: bytes, now: float) -> str | None:
        item = self._map.get(session)
        if item is None:
            return None
        name, expires = item
        if now >= expires:
            del self._map[session]
            return None
        self._map.move_to_end(session)
        return name

    def put(self, session: bytes, name: str, now: float) -> None:
        self._map[session] = (name, now + self.ttl)
        self._map.move_to_end(session)
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)
