"""A listener ``DeltaSink`` that records what a block-chain tracker emits: the resulting key → tier state,
every op and every clear. ``strict``: a delete of a key the sink does not hold fails the test."""

from __future__ import annotations


class RecordingSink:
    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.state: dict[int, str] = {}
        self.ops: list[tuple[str, list[int], str | None]] = []
        self.clears: list[str] = []
        self.pages: list[int] = []  # the page size each put carried (0: not from a store)

    def emit(self, op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
        self.ops.append((op, list(keys), tier))
        if op == "put":
            self.pages.append(page)
        for k in keys:
            if op == "put":
                assert tier is not None
                self.state[k] = tier
            else:
                assert k in self.state or not self.strict, f"del of a key never put: {k:016x}"
                self.state.pop(k, None)

    def clear(self, reason: str) -> None:
        self.clears.append(reason)
        self.state.clear()
