"""Engine preemption windows: each endpoint's ``vllm:num_preemptions_total`` as the engine signals scraper reads
it, kept as a short series, and whether it rose in the window around a request. That is the seed's *window
exposure* (the engine preempted some request while this one ran, or just before it), never a claim that this
request was preempted. See docs/experiments.md, "Preemption windows".
"""

from __future__ import annotations

from collections import deque

MAX_SAMPLES = 512  # per endpoint, oldest dropped first (at the default 1 s scrape interval: 8.5 minutes)


class PreemptionWindows:
    """``note`` each scrape's counter; ``exposure`` over a window. Bound: ``MAX_SAMPLES`` per endpoint, one
    series per endpoint the scraper follows (``forget`` when it leaves the pool). Times are monotonic seconds,
    the scraper's clock."""

    def __init__(self) -> None:
        self._series: dict[str, deque[tuple[float, float]]] = {}

    def note(self, name: str, at: float, total: float | None) -> None:
        """One scrape of ``name``: its counter (None: the engine does not report it; the series is dropped, so a
        window over it is unknown, not zero)."""
        if total is None:
            self._series.pop(name, None)
            return
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = deque(maxlen=MAX_SAMPLES)
        series.append((at, total))

    def forget(self, name: str) -> None:
        self._series.pop(name, None)

    def exposure(self, name: str, start: float, end: float) -> int | None:
        """1 when ``name``'s counter rose between the last scrape at or before ``start`` and the last at or before
        ``end``, 0 when it did not, None when unknown: no series, no scrape at or before ``start`` (the window is
        not covered), or the counter went back (the engine restarted)."""
        series = self._series.get(name)
        if not series:
            return None
        first = last = None
        for at, total in reversed(series):  # newest first: a window ends near now, a few samples back
            if last is None and at <= end:
                last = total
            if at <= start:
                first = total
                break
        if first is None or last is None:
            return None
        if last < first:
            return None
        return 1 if last > first else 0

    def __len__(self) -> int:
        return len(self._series)
