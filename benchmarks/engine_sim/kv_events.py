"""KV-cache events over ZMQ in the vLLM wire format (docs/wire.md §3), plus the SGLang flavour.

PUB socket, three frames per message: ``[topic, seq as 8 bytes big-endian, msgpack payload]``; the
payload is the positional batch ``[ts, events, data_parallel_rank]``; ``seq`` grows by one per batch
and restarts at 0 on ``reset_sequence()`` (engine restart).

Event encodings (``encoding``):

- ``array``: positional arrays, tag first (vLLM before mid-2026, older SGLang):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
- ``map``: the same fields by name with the tag under ``"type"`` (newer vLLM and SGLang); fields left at
  None are omitted in the SGLang flavour.

Hash forms (``hash_form``): ``uint64`` (vLLM default, may exceed 2^63) or ``bytes`` (the 32-byte
sha256 digest, as with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). The ``sglang`` flavour always sends
signed int64 hashes, one ``BlockStored`` per page, and 2-frame replay replies; ``sglang_page_size``
(a divisor of the cache's block size, 1 being SGLang's common default) splits every block into pages of
that many tokens, each with its own hash (removals name every page of the block).

Salted and LoRA requests (docs/wire.md §3-4, as vLLM 0.33 and SGLang 0.5.23 publish them): the vLLM flavour
sends ``lora_id``, ``lora_name`` and ``extra_keys`` (one entry per block: the adapter name on every block,
then the cache salt on the first block of a chain, None when a block has neither; appended after
``lora_name`` in the array encoding); the SGLang flavour sends ``lora_id``, ``lora_name`` and
``cache_salt`` as plain fields of every page (map encoding).

Replay: a ROUTER socket. A request is one frame holding the start seq (8 bytes big-endian); a DEALER
sends ``[b"", seq8]``. The reply mirrors the request's envelope (the empty delimiter frame is echoed
when the request had one) and then sends, for every buffered batch with seq >= start,
``[seq8, payload]`` (``replay_layout="seq"``: older vLLM, SGLang) or ``[topic, seq8, payload]``
(``"topic"``: newest vLLM), followed by the end marker ``[END_SEQ, b""]`` (``[b"", END_SEQ, b""]`` in the
topic layout) where ``END_SEQ`` is ``ff``×8.

Dropped batches (fault injection) are kept in the replay buffer but not sent on the PUB socket, so a
subscriber sees a sequence gap it can repair by replay, as after a real network drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from hashlib import sha256
from typing import Any, Literal

import msgpack
import zmq.asyncio
from zmq import constants as zmq_constants

from benchmarks.engine_sim.prefix_cache import hash_as_int64, hash_as_uint64

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
EventEncoding = Literal["array", "map"]
HashForm = Literal["uint64", "bytes"]
Flavour = Literal["vllm", "sglang"]
ReplayLayout = Literal["seq", "topic"]
MEDIUM_GPU = "GPU"


@dataclass(slots=True, frozen=True)
class BlockStoredEvent:
    """Consecutive full blocks stored; ``parent`` is the digest before ``digests[0]`` (None at root)."""

    digests: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None  # the LoRA adapter the request targeted
    cache_salt: str | None = None  # the request's cache_salt


@dataclass(slots=True, frozen=True)
class BlockRemovedEvent:
    """Blocks evicted from the GPU cache."""

    digests: tuple[bytes, ...]


@dataclass(slots=True, frozen=True)
class AllBlocksClearedEvent:
    """The whole cache was dropped (restart, reset)."""


KvEvent = BlockStoredEvent | BlockRemovedEvent | AllBlocksClearedEvent


@dataclass(slots=True, frozen=True)
class KvEventsSettings:
    """Where and how the simulator publishes KV events."""

    endpoint: str = "tcp://127.0.0.1:0"  # port 0: bind an ephemeral port
    replay_endpoint: str | None = "tcp://127.0.0.1:0"  # None: no replay socket
    topic: str = ""
    encoding: EventEncoding = "array"
    hash_form: HashForm = "uint64"
    flavour: Flavour = "vllm"
    replay_layout: ReplayLayout = "seq"
    bind: bool | None = None  # None: vLLM's rule (bind on *, ::, 0.0.0.0, ipc://, inproc://, port 0)
    replay_buffer_batches: int = 10_000  # vLLM's default buffer_steps
    dp_rank: int = 0
    sglang_page_size: int | None = None  # sglang flavour: pages of this many tokens (None: the block size)


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind on wildcard hosts and local transports, else connect."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host_port = endpoint.split("://", 1)[-1]
    return any(w in host_port for w in ("*", "::", "0.0.0.0")) or host_port.endswith(":0")


def lora_id_of(lora_name: str) -> int:
    """A stable positive int id for an adapter name (vLLM numbers adapters from 1)."""
    return 1 + zlib.crc32(lora_name.encode("utf-8")) % 65_535


def page_digest(block_digest: bytes, page: int) -> bytes:
    """The hash of page ``page`` of a block split into smaller SGLang pages."""
    return sha256(block_digest + page.to_bytes(4, "big")).digest()


class KvEventEncoder:
    """Turns simulator events into wire objects for one (flavour, encoding, hash form)."""

    def __init__(
        self, encoding: EventEncoding, hash_form: HashForm, flavour: Flavour, sglang_page_size: int | None = None
    ) -> None:
        self.encoding = encoding
        self.hash_form = hash_form
        self.flavour = flavour
        self.page_size = sglang_page_size if flavour == "sglang" else None
        self._block_size: int | None = None  # the cache's block size, learnt from the first store

    def wire_hash(self, digest: bytes) -> int | bytes:
        """The published form of one engine hash."""
        if self.flavour == "sglang":
            return hash_as_int64(digest)
        return hash_as_uint64(digest) if self.hash_form == "uint64" else digest

    def encode_events(self, events: Sequence[KvEvent]) -> list[Any]:
        """Wire objects for ``events`` (SGLang splits multi-block stores into one event per page)."""
        out: list[Any] = []
        for event in events:
            if isinstance(event, BlockStoredEvent) and self.flavour == "sglang":
                bs = self._block_size = event.block_size
                ps = self.page_size or bs
                if bs % ps:
                    raise ValueError(f"sglang_page_size {ps} does not divide the block size {bs}")
                parent = self._last_page(event.parent, bs)
                for i, d in enumerate(event.digests):
                    for j in range(bs // ps):
                        pd = d if ps == bs else page_digest(d, j)
                        toks = event.token_ids[i * bs + j * ps : i * bs + (j + 1) * ps]
                        out.append(
                            self._encode_one(
                                replace(event, digests=(pd,), parent=parent, token_ids=toks, block_size=ps)
                            )
                        )
                        parent = pd
            elif isinstance(event, BlockRemovedEvent) and self.page_size:
                out.append(self._encode_one(BlockRemovedEvent(tuple(self._pages(event.digests)))))
            else:
                out.append(self._encode_one(event))
        return out

    def _last_page(self, digest: bytes | None, block_size: int) -> bytes | None:
        ps = self.page_size
        if digest is None or not ps or ps == block_size:
            return digest
        return page_digest(digest, block_size // ps - 1)

    def _pages(self, digests: Sequence[bytes]) -> list[bytes]:
        ps, bs = self.page_size, self._block_size
        if not ps or not bs or ps == bs:
            return list(digests)
        return [page_digest(d, j) for d in digests for j in range(bs // ps)]

    def _encode_one(self, event: KvEvent) -> Any:
        fields: list[tuple[str, Any]]
        if isinstance(event, BlockStoredEvent):
            tag = "BlockStored"
            lora = event.lora_name or None
            fields = [
                ("block_hashes", [self.wire_hash(d) for d in event.digests]),
                ("parent_block_hash", None if event.parent is None else self.wire_hash(event.parent)),
                ("token_ids", list(event.token_ids)),
                ("block_size", event.block_size),
                ("lora_id", None if lora is None else lora_id_of(lora)),
                ("medium", MEDIUM_GPU),
                ("lora_name", lora),
            ]
            if self.flavour == "sglang":
                if self.encoding == "map":  # later positions of SGLang's array form are not decoded
                    fields.append(("cache_salt", event.cache_salt or None))
            elif lora is not None or event.cache_salt:
                fields.append(("extra_keys", self._extra_keys(event)))
        elif isinstance(event, BlockRemovedEvent):
            tag = "BlockRemoved"
            fields = [("block_hashes", [self.wire_hash(d) for d in event.digests]), ("medium", MEDIUM_GPU)]
        else:
            tag = "AllBlocksCleared"
            fields = []
        if self.encoding == "array":
            return [tag, *(value for _, value in fields)]
        mapped: dict[str, Any] = {"type": tag}
        for name, value in fields:
            if value is None and self.flavour == "sglang":
                continue  # SGLang omits optional fields left at None
            mapped[name] = value
        return mapped

    @staticmethod
    def _extra_keys(event: BlockStoredEvent) -> list[list[str] | None]:
        """vLLM 0.33: the adapter name on every block, the salt after it on a chain's first block."""
        out: list[list[str] | None] = []
        for i in range(len(event.digests)):
            extras = [event.lora_name] if event.lora_name else []
            if i == 0 and event.parent is None and event.cache_salt:
                extras.append(event.cache_salt)
            out.append(extras or None)
        return out

    def encode_batch(self, events: Sequence[KvEvent], ts: float, dp_rank: int) -> bytes:
        """The msgpack payload of one batch ``[ts, events, dp_rank]``."""
        packed: bytes = msgpack.packb([ts, self.encode_events(events), dp_rank], use_bin_type=True)
        return packed


class KvEventPublisher:
    """Publishes batches of KV events on a ZMQ PUB socket and serves replay on a ROUTER socket.

    Replay buffer bound: ``settings.replay_buffer_batches`` batches, oldest dropped first.
    """

    def __init__(self, settings: KvEventsSettings, drop_seed: int = 0) -> None:
        self.settings = settings
        layout: ReplayLayout = "seq" if settings.flavour == "sglang" else settings.replay_layout
        self.replay_layout = layout
        self.encoder = KvEventEncoder(
            settings.encoding, settings.hash_form, settings.flavour, settings.sglang_page_size
        )
        self._topic = settings.topic.encode("utf-8")
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.replay_buffer_batches)
        self._next_seq = 0
        self._drop_next = 0
        self._drop_rate = 0.0
        self._drop_rng = random.Random(drop_seed)
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.batches_published = 0
        self.batches_dropped = 0

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry."""
        return self._next_seq

    async def start(self) -> None:
        """Open the sockets (PUB bound or connected, ROUTER bound) and start serving replay."""
        self._ctx = zmq.asyncio.Context()
        pub = self._ctx.socket(zmq_constants.PUB)
        pub.setsockopt(zmq_constants.LINGER, 0)
        endpoint = self.settings.endpoint
        bind = publisher_binds(endpoint) if self.settings.bind is None else self.settings.bind
        if bind:
            pub.bind(_ephemeral(endpoint))
            self.endpoint = pub.getsockopt(zmq_constants.LAST_ENDPOINT).decode()
        else:
            pub.connect(endpoint)
            self.endpoint = endpoint
        self._pub = pub
        if self.settings.replay_endpoint:
            router = self._ctx.socket(zmq_constants.ROUTER)
            router.setsockopt(zmq_constants.LINGER, 0)
            router.bind(_ephemeral(self.settings.replay_endpoint))
            self.replay_endpoint = router.getsockopt(zmq_constants.LAST_ENDPOINT).decode()
            self._router = router
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-sim-replay")
        log.info(
            "kv_events_started endpoint=%s bind=%s replay=%s encoding=%s hash_form=%s flavour=%s",
            self.endpoint,
            bind,
            self.replay_endpoint,
            self.settings.encoding,
            self.settings.hash_form,
            self.settings.flavour,
        )

    async def close(self) -> None:
        """Stop replay and close the sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def set_drops(self, drop_next: int | None = None, drop_rate: float | None = None) -> None:
        """Fault switch: drop the next ``drop_next`` batches and/or each batch with ``drop_rate``."""
        if drop_next is not None:
            self._drop_next = max(0, drop_next)
        if drop_rate is not None:
            self._drop_rate = min(1.0, max(0.0, drop_rate))

    def reset_sequence(self) -> None:
        """Engine restart: the next batch has seq 0 and the replay buffer is emptied."""
        self._next_seq = 0
        self._buffer.clear()

    async def publish(self, events: Sequence[KvEvent]) -> int | None:
        """Publish one batch; returns its seq (None when ``events`` is empty)."""
        if not events:
            return None
        seq = self._next_seq
        self._next_seq += 1
        payload = self.encoder.encode_batch(events, time.time(), self.settings.dp_rank)
        self._buffer.append((seq, payload))
        dropped = False
        if self._drop_next > 0:
            self._drop_next -= 1
            dropped = True
        elif self._drop_rate > 0 and self._drop_rng.random() < self._drop_rate:
            dropped = True
        if dropped:
            self.batches_dropped += 1
            log.info("kv_events_batch_dropped seq=%d", seq)
            return seq
        if self._pub is not None:
            await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self.batches_published += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) < 2:
                continue
            envelope = [frames[0]]
            rest = frames[1:]
            if len(rest) >= 2 and rest[0] == b"":
                envelope.append(b"")
                rest = rest[1:]
            if len(rest) != 1 or len(rest[0]) != 8:
                log.warning("kv_events_replay_bad_request frames=%d", len(frames))
                continue
            start = int.from_bytes(rest[0], "big")
            topic = [self._topic] if self.replay_layout == "topic" else []
            batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                await router.send_multipart([*envelope, *topic, seq.to_bytes(8, "big"), payload])
            end_topic = [b""] if self.replay_layout == "topic" else []
            await router.send_multipart([*envelope, *end_topic, END_SEQ, b""])
            log.info("kv_events_replay_served start=%d batches=%d", start, len(batches))


def _ephemeral(endpoint: str) -> str:
    """ZMQ spells 'any free port' as ``*``; accept ``:0`` too."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint
