"""How often each prefix is asked for: a decaying request rate per held prefix, bounded, for the cost model.
See docs/picker.md, "Prefix demand".
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
