"""Issue 8, end to end with real processes: two pickers subscribed to one listener (one over the gRPC
feed, one over SSE) hold identical indexes, equal to the engine's true cached blocks, after 10,000
engine events with faults injected: 5% of the batches dropped on the PUB socket (repaired by replay)
and the listener killed (SIGKILL) and restarted while the engine keeps publishing.

The engine is the simulator's own publisher (``benchmarks.engine_sim.kv_events``: the vLLM wire format,
PUB + replay ROUTER) driven by a seeded random workload of stores and leaf-first removals; the truth is
computed here from the same workload with the project's block keys."""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
from typing import Any

import msgpack
import pytest

from benchmarks.engine_sim.kv_events import BlockRemovedEvent, BlockStoredEvent, KvEventPublisher, KvEventsSettings
from benchmarks.stack import free_port, make_workdir, start_listener, start_picker
from picker.shared.block_keys import request_block_keys
from tests.integration.conftest import http
from tests.support.poll import wait_until

MODEL = "m"
BS = 16
EVENTS = 10_000
PER_BATCH = 10


class Workload:
    """Seeded chains of blocks: stores (new chains, extensions) and leaf-first removals, with the truth."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.chains: list[list[tuple[bytes, int]]] = []  # per chain: (engine digest, our key) per block
        self.tokens: list[list[int]] = []
        self.n = 0

    def _digest(self) -> bytes:
        self.n += 1
        return hashlib.sha256(b"eng" + self.n.to_bytes(8, "big")).digest()

    def event(self) -> BlockStoredEvent | BlockRemovedEvent:
        rng = self.rng
        live = [i for i, c in enumerate(self.chains) if c]
        if live and rng.random() < 0.35:
            i = rng.choice(live)
            k = min(len(self.chains[i]), rng.randint(1, 2))
            gone = self.chains[i][-k:]
            del self.chains[i][-k:]
            del self.tokens[i][len(self.chains[i]) * BS :]
            return BlockRemovedEvent(tuple(d for d, _ in reversed(gone)))
        if live and (len(self.chains) >= 200 or rng.random() < 0.5):
            i = rng.choice(live)
        else:
            self.chains.append([])
            self.tokens.append([])
            i = len(self.chains) - 1
        parent = self.chains[i][-1][0] if self.chains[i] else None
        new = [rng.randrange(1, 50_000) for _ in range(BS * rng.randint(1, 3))]
        self.tokens[i].extend(new)
        keys = request_block_keys(self.tokens[i], BS, MODEL)
        digests = []
        for _ in range(len(new) // BS):
            d = self._digest()
            digests.append(d)
            self.chains[i].append((d, keys[len(self.chains[i])]))
        return BlockStoredEvent(tuple(digests), parent, tuple(new), BS)

    def truth_digest(self) -> tuple[int, str]:
        """(entries, the admin's entries_digest) of every block still cached (all GPU)."""
        keys = sorted({k for c in self.chains for _, k in c})
        h = hashlib.sha256()
        for k in keys:
            h.update(k.to_bytes(8, "big") + b"g")
        return len(keys), h.hexdigest()[:32]


def backend_view(picker: Any) -> tuple[int, str]:
    b = http("GET", picker.admin_url + "/admin/kv-index/backends").json()["backends"][0]
    return int(b["entries"]), str(b["entries_digest"])


async def publish(pub: KvEventPublisher, work: Workload, events: int) -> None:
    for _ in range(events // PER_BATCH):
        await pub.publish([work.event() for _ in range(PER_BATCH)])
        await asyncio.sleep(0.001)


@pytest.mark.timeout(240)
async def test_two_pickers_equal_the_engine_after_drops_and_a_listener_restart() -> None:
    workdir = make_workdir("kv-epp-two-pickers-")
    # The engine's replay buffer (400 batches) covers the listener's downtime (200 batches) but not the
    # whole history (1,000): only the listener's persisted state brings back what was stored before.
    settings = KvEventsSettings(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", replay_buffer_batches=400
    )
    pub = KvEventPublisher(settings, drop_seed=7)
    await pub.start()
    work = Workload(seed=11)
    grpc_port = free_port()
    listener_cfg = {
        "listen": f"127.0.0.1:{free_port()}",
        "grpc": {"listen": f"127.0.0.1:{grpc_port}"},
        "state": {"path": str(workdir / "listener-state.bin"), "interval_seconds": 0.5},
        "feed": {"keepalive_seconds": 1.0},
        "sources": [
            {
                "backend_name": "eng",
                "model": MODEL,
                "zmq_endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
            }
        ],
    }
    procs: list[Any] = []
    loop = asyncio.get_running_loop()
    listener = start_listener(listener_cfg, workdir)
    try:
        pickers = []
        for name, endpoint in (
            ("picker-grpc", f"grpc://127.0.0.1:{grpc_port}"),
            ("picker-sse", listener.events_url("eng")),
        ):
            cfg = {
                "prefix_routing": {"enabled": True},
                "kv_cache_index": {
                    "enabled": True,
                    "max_entries": 1_000_000,
                    "event_sources": [{"backend_name": "eng", "endpoint": endpoint, "reconnect_interval_ms": 100}],
                    "tokenizer": {"source": "none", "block_size": BS},
                    "checks": {"self_check": False},
                },
                "pool": {"backends": [{"name": "eng", "address": f"127.0.0.1:{free_port()}"}]},
            }
            pickers.append(start_picker(cfg, workdir, name=name))
        procs.extend(pickers)
        wait_until(
            lambda: all(
                http("GET", p.admin_url + "/admin/kv-index/backends").json()["backends"][0]["connection"]["connected"]
                for p in pickers
            ),
            timeout=20.0,
            what="both pickers' feeds to connect",
        )
        pub.set_drops(drop_rate=0.05)
        await publish(pub, work, EVENTS // 2 - 50)
        pub.set_drops(drop_rate=0.0)
        await publish(pub, work, 50)  # a clean tail: the listener sees (and repairs) every gap before the kill
        state_file = workdir / "listener-state.bin"

        def saved_through_last_batch() -> bool:
            # the kill comes after a save that covers every batch published: the engine's replay buffer
            # (400 batches) must cover what the listener misses after its last save, a bound we choose
            # here rather than leave to how fast the 0.5 s save interval turns on a busy machine
            try:
                doc = msgpack.unpackb(state_file.read_bytes(), raw=False)
            except (OSError, ValueError):
                return False
            return bool(doc["sources"]["eng"]["last_seq"] == pub.next_seq - 1)

        await loop.run_in_executor(
            None, lambda: wait_until(saved_through_last_batch, timeout=30.0, what="a state save of every batch")
        )
        listener.process.stop(sig=signal.SIGKILL)
        pub.set_drops(drop_rate=0.05)
        await publish(pub, work, EVENTS // 5)  # the engine keeps publishing while the listener is down
        listener = start_listener(listener_cfg, workdir)
        await publish(pub, work, EVENTS - EVENTS // 2 - EVENTS // 5 - 100)
        pub.set_drops(drop_rate=0.0)
        await publish(pub, work, 100)  # a clean tail: a drop at the very end would be a gap nobody sees
        truth = work.truth_digest()
        assert pub.batches_dropped > 0 and truth[0] > 1000

        def converged() -> bool:
            return all(backend_view(p) == truth for p in pickers)

        await loop.run_in_executor(
            None, lambda: wait_until(converged, timeout=60.0, what="both pickers to equal the engine's blocks")
        )
        views = [backend_view(p) for p in pickers]
        print(f"\nengine blocks={truth[0]} dropped batches={pub.batches_dropped} picker views={views}")
        assert views[0] == views[1] == truth
    finally:
        for p in procs:
            p.stop()
        listener.stop()
        await pub.close()
