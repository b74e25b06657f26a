"""How often each prefix is asked for: a decaying request rate per prefix.

The key is the block key that ends the longest prefix of the request some endpoint holds (chained block
keys name a whole prefix), so a hot document that every request carries has one key with a high rate,
while a conversation, whose held prefix grows each turn, has a new key every turn.

``hit(key, now)`` counts one request and returns the key's rate in requests per second before it, an
exponentially decaying average with time constant ``tau_s`` (each request adds ``1/tau_s``; the sum
halves every ``tau_s·ln 2`` seconds without requests): a prefix seen for the first time has rate 0.
The cost model uses it to share a copy's prefill among the requests that will find the copy (a hot
prefix is worth a second holder; a prefix asked for once is not).

Bounds: ``max_keys`` keys, least recently asked for dropped first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable


class PrefixRates:
    def __init__(self, max_keys: int = 65_536, tau_s: float = 10.0) -> None:
        self.max_keys = max_keys
        self.tau = tau_s
        self._rates: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key → (rate, at)

    def __len__(self) -> int:
        return len(self._rates)

    def hit(self, key: Hashable, now: float) -> float:
        """Count one request; returns the rate before it (the prefix's demand so far, 0 the first time)."""
        prev = self._rates.pop(key, None)
        before = prev[0] * math.exp(-max(0.0, now - prev[1]) / self.tau) if prev is not None else 0.0
        self._rates[key] = (before + 1.0 / self.tau, now)
        if len(self._rates) > self.max_keys:
            self._rates.popitem(last=False)
        return before
