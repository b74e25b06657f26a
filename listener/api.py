"""The listener's public entry points, for the benchmarks (the import contracts allow them this module only).
See docs/listener.md."""

from __future__ import annotations

from listener.app import ListenerApp
from listener.block_chains import BlockChainTracker, work_units
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.events import DecodeError
from listener.msgpack_decoder import decode_batch

__all__ = [
    "BlockChainTracker",
    "DecodeError",
    "LimitsConfig",
    "ListenerApp",
    "ListenerConfig",
    "SourceConfig",
    "decode_batch",
    "work_units",
]
