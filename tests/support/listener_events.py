"""vLLM KV events as the listener decodes them (stored, placeholder, removed; tokens per tag), a source
config, random workloads, and ``Live``: a tracker fed the full stream beside the event log a listener with
``state.path`` keeps, restorable from the compacted log."""

from __future__ import annotations

import random
from typing import Any

import msgpack

from listener.block_chains import BlockChainTracker
from listener.config import LimitsConfig, SourceConfig
from listener.msgpack_decoder import decode_batch
from listener.state_log import EventLog, compact
from tests.support.recording_sink import RecordingSink

KB = 16
MODEL = "m"


def src_cfg(offload: bool = False, engine: str = "vllm") -> SourceConfig:
    return SourceConfig(
        backend_name="e1",
        engine=engine,  # type: ignore[arg-type]
        model=MODEL,
        zmq_endpoint="tcp://127.0.0.1:1",
        treat_eviction_as_offload=offload,
    )


class Live:
    """A tracker fed the full stream, and the event log a listener with ``state.path`` keeps beside it."""

    def __init__(self, offload: bool = False, limits: LimitsConfig | None = None) -> None:
        self.limits = limits or LimitsConfig()
        self.cfg = src_cfg(offload)
        self.sink = RecordingSink()
        self.tracker = BlockChainTracker(self.cfg, self.limits, self.sink, key_block_size=KB)
        self.log = EventLog(treat_eviction_as_offload=offload)

    def apply(self, events: list[Any]) -> None:
        batch = decode_batch(msgpack.packb([0.0, events, 0]), "vllm", self.limits.max_event_tokens, self.limits)
        assert not batch.dropped
        self.tracker.apply_all(batch.events)
        self.log.record_events(batch.raw_events)

    def restored(self) -> Live:
        """A listener restarted from the compacted log (replayed through decoder, tracker and a new log)."""
        other = Live(self.cfg.treat_eviction_as_offload, self.limits)
        events = compact(self.log.view()).events
        if events:
            other.apply([msgpack.unpackb(e) for e in events])
        return other


def toks(tag: int, n: int = 1) -> list[int]:
    return [tag * 1000 + i for i in range(n * KB)]


def store(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": KB,
        "medium": medium,
    }


def placeholder(hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "medium": medium,
    }


def remove(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def random_workload(rng: random.Random, n: int) -> list[list[dict[str, Any]]]:
    """Batches of GPU stores (roots, extensions, second copies), GPU removals (ancestors, whole chains), CPU
    placeholders (of known and of forgotten blocks), CPU removals, STORAGE copies (placeholders and stores
    with tokens) and their removals, and a rare AllBlocksCleared."""
    chains: list[list[int]] = []
    info: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens): hashes are deterministic
    next_hash = 1
    batches: list[list[dict[str, Any]]] = []

    def run_of(chain: list[int]) -> list[int]:
        i = rng.randrange(len(chain))
        return chain[i : rng.randint(i + 1, len(chain))]

    def stored(hashes: list[int], medium: str) -> dict[str, Any]:
        tokens = [t for h in hashes for t in info[h][1]]
        return store(hashes, info[hashes[0]][0], tokens, medium)

    for _ in range(n):
        batch: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if not chains or r < 0.25:
                parent_chain = rng.choice(chains) if chains and rng.random() < 0.5 else None
                parent = parent_chain[-1] if parent_chain else None
                hashes = []
                for _ in range(rng.randint(1, 3)):
                    info[next_hash] = (parent, toks(next_hash))
                    parent = next_hash
                    hashes.append(next_hash)
                    next_hash += 1
                chains.append((parent_chain or []) + hashes)
                batch.append(stored(hashes, "GPU"))
            elif r < 0.33:
                batch.append(stored(run_of(rng.choice(chains)), "GPU"))  # a second copy (or a re-store)
            elif r < 0.50:
                batch.append(remove(run_of(rng.choice(chains)), "GPU"))
            elif r < 0.62:
                batch.append(placeholder(run_of(rng.choice(chains)), rng.choice(["CPU", "CPU", "STORAGE"])))
            elif r < 0.72:
                batch.append(remove(run_of(rng.choice(chains)), rng.choice(["CPU", "CPU", "STORAGE"])))
            elif r < 0.80:
                batch.append(stored(run_of(rng.choice(chains)), "STORAGE"))
            elif r < 0.81:
                batch.append({"type": "AllBlocksCleared"})
            elif r < 0.86 and len(chains) > 8:
                chains.pop(rng.randrange(len(chains)))
        batches.append(batch)
    return batches
