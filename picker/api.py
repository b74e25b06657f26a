"""kv-epp's public Python entry points: what the benchmarks (and anyone embedding the picker) import.

Everything else under ``picker`` is internal and may move; an import-linter contract keeps the
benchmarks on this module and on ``picker.shared``.
"""

from __future__ import annotations

from picker.config import Settings, load_settings, parse_settings
from picker.extproc.messages import DEST_HEADER, pick_response, streamed_chunks
from picker.extproc.service import ExternalProcessor
from picker.facts import Answer
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_index import RedisKvIndex
from picker.kv.redis_layout import CLUSTER_KEY_PREFIX
from picker.request.exchange import Exchange
from picker.request.path import Inbound, RequestPath
from picker.routing.endpoints import BackendHold, Endpoint, EndpointState, PoolView
from picker.routing.kv_scorer import KvOverlapScorer
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from picker.runtime.envoy_config import EnvoyOptions, bootstrap_yaml
from picker.runtime.lifecycle import GRPC_OPTIONS

__all__ = [
    "CLUSTER_KEY_PREFIX",
    "DEST_HEADER",
    "GRPC_OPTIONS",
    "Answer",
    "BackendHold",
    "Endpoint",
    "EndpointState",
    "EnvoyOptions",
    "Exchange",
    "ExternalProcessor",
    "InMemoryKvIndex",
    "Inbound",
    "KvOverlapScorer",
    "PickerApp",
    "PoolView",
    "RedisKvIndex",
    "RequestPath",
    "Settings",
    "bootstrap_yaml",
    "build_app",
    "load_settings",
    "parse_settings",
    "pick_response",
    "streamed_chunks",
]
