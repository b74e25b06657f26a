"""Storage tiers of a cached block, as the KV index and the listener feed name them."""

from __future__ import annotations

from enum import StrEnum


class StorageTier(StrEnum):
    """Where a backend holds a cached block (the seed's tiers); NONE when it holds nothing."""

    GPU_HOT = "gpu_hot"
    STORAGE_WARM = "storage_warm"
    NONE = "none"
