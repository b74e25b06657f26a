"""The queues of flow control: a queued request (``Item``), a flow's own queue (FCFS or earliest deadline), a
priority band and the fairness policy that picks its next flow. Pure data structures, no clock and no I/O: the
controller (``picker.flow.controller``) owns time, bounds and outcomes. See docs/flow-control.md, "Queues".
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_FLOW = "default-flow"

_seq = itertools.count()


@dataclass(slots=True, eq=False)
class Item:
    """One queued request. ``cost``: the tokens it will take from the pool (prompt estimate plus expected
    output), what the token-weighted policy counts; ``nbytes``: what it holds of the queue's byte bounds."""

    fairness_id: str
    priority: int
    nbytes: int
    cost: int
    arrived: float  # monotonic
    expires: float  # monotonic: dropped (TTL) at this instant
    deadline: float  # monotonic: the ordering key of earliest-deadline-first (the SLO, else ``expires``)
    waiter: asyncio.Future[object]  # resolved with what ``run`` returned, or the drop's answer
    run: Callable[[], object]  # what dispatch does (the request path's decide and commit)
    seq: int = field(default_factory=lambda: next(_seq))
    gone: bool = False  # removed (dispatched, dropped or cancelled): skipped where it still sits in a heap


class Flow:
    """The queued requests of one (fairness id, priority). ``edf``: earliest deadline first, else arrival order."""

    __slots__ = ("_fifo", "_heap", "edf", "key", "live", "vtime")

    def __init__(self, key: tuple[str, int], edf: bool) -> None:
        self.key = key
        self.edf = edf
        self._fifo: deque[Item] = deque()
        self._heap: list[tuple[float, int, Item]] = []
        self.live = 0  # items not gone
        self.vtime = 0.0  # token_weighted: the service this flow has had (virtual time)

    def push(self, item: Item) -> None:
        self.live += 1
        if self.edf:
            heapq.heappush(self._heap, (item.deadline, item.seq, item))
        else:
            self._fifo.append(item)

    def head(self) -> Item | None:
        """The request this flow would dispatch next (gone ones are dropped from the front on the way)."""
        if self.edf:
            h = self._heap
            while h and h[0][2].gone:
                heapq.heappop(h)
            return h[0][2] if h else None
        q = self._fifo
        while q and q[0].gone:
            q.popleft()
        return q[0] if q else None

    def pop(self) -> Item:
        item = self.head()
        assert item is not None
        if self.edf:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self.live -= 1
        return item

    def forget(self, item: Item) -> None:
        """``item`` left the queue from the middle (dropped or cancelled): it is skipped when it reaches the
        front. Its memory is freed then, or at ``compact`` when most of the flow is gone."""
        self.live -= 1
        n = len(self._heap) if self.edf else len(self._fifo)
        if n > 64 and self.live * 2 < n:
            self.compact()

    def items(self) -> list[Item]:
        """The flow's queued requests (a copy: the caller may remove them)."""
        entries = (e[2] for e in self._heap) if self.edf else iter(self._fifo)
        return [i for i in entries if not i.gone]

    def compact(self) -> None:
        if self.edf:
            self._heap = [e for e in self._heap if not e[2].gone]
            heapq.heapify(self._heap)
        else:
            self._fifo = deque(i for i in self._fifo if not i.gone)


class Band:
    """The flows of one priority, and the fairness policy between them: ``global_fifo`` (the flow whose head
    arrived first), ``round_robin`` (flows in turn) or ``token_weighted`` (least attained service: the flow
    that has had the fewest tokens; a flow that becomes backlogged starts at the band's current virtual time,
    so it can neither starve the others with credit saved while idle nor be starved)."""

    __slots__ = ("_turn", "fairness", "flows", "priority", "vclock")

    def __init__(self, priority: int, fairness: str) -> None:
        self.priority = priority
        self.fairness = fairness
        self.flows: dict[str, Flow] = {}  # fairness id -> flow with queued requests
        self._turn: deque[str] = deque()  # round_robin: the order of turns
        self.vclock = 0.0  # token_weighted: the virtual time of the last dispatch

    def add(self, flow: Flow) -> None:
        self.flows[flow.key[0]] = flow
        self._turn.append(flow.key[0])
        flow.vtime = max(flow.vtime, self.vclock)

    def remove(self, fairness_id: str) -> None:
        self.flows.pop(fairness_id, None)
        try:
            self._turn.remove(fairness_id)
        except ValueError:
            pass

    def pick(self) -> Flow | None:
        """The flow the fairness policy serves next (None: nothing queued). Does not dispatch."""
        best: Flow | None = None
        if self.fairness == "round_robin":
            for _ in range(len(self._turn)):
                f = self.flows[self._turn[0]]
                if f.head() is not None:
                    return f
                self._turn.rotate(-1)
            return None
        best_key: tuple[float, int] | None = None
        for f in self.flows.values():
            h = f.head()
            if h is None:
                continue
            key = (f.vtime, h.seq) if self.fairness == "token_weighted" else (float(h.seq), 0)
            if best_key is None or key < best_key:
                best, best_key = f, key
        return best

    def served(self, flow: Flow, item: Item) -> None:
        """``item`` of ``flow`` was dispatched: account it to the policy."""
        if self.fairness == "round_robin" and self._turn and self._turn[0] == flow.key[0]:
            self._turn.rotate(-1)
        elif self.fairness == "token_weighted":
            self.vclock = flow.vtime
            flow.vtime += max(1, item.cost)
