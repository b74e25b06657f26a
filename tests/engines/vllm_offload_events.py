"""vLLM's own KV events for one block offloaded to CPU and STORAGE (issue 20), as its ZMQ publisher sends them.

``offload_sequence_payloads()`` runs the installed vLLM's code (``.venv-engines`` only; vLLM is imported
inside the function) and returns the msgpack payloads of six ``KVEventBatch``es, each encoded as
``ZmqEventPublisher`` does (``msgspec.msgpack.Encoder().encode(batch)``):

1. GPU store: ``BlockPool.cache_full_blocks`` for a 65-token prompt, page size 32: one ``BlockStored``
   with the two full pages (two hashes, 64 token ids, ``block_size`` 32, medium ``GPU``, group 0).
2. CPU store: the offloading connector's ``OffloadingEventsTracker`` with self-describing events, one chunk
   of two pages (``kv_connector_extra_config`` ``block_size`` 64): the chunk's per-page hashes, its 64
   token ids, ``block_size`` 32, medium ``CPU``, ``kv_cache_spec_kind`` ``full_attention``.
3. STORAGE store of the same chunk by a secondary tier, ``locality`` ``LOCAL``, ``ownership`` set (the fs
   and obj tiers set the locality, KVCR the ownership; the tracker forwards both).
4. GPU eviction: the pool reuses the freed pages: one ``BlockRemoved`` per page (medium ``GPU``).
5. STORAGE removal of the chunk (fanned out to both page hashes, ``locality`` and ``ownership`` as stored).
6. CPU removal of the chunk (the primary tier's eviction).

Block hashes are vLLM's (sha256_cbor, the default seed), published as 64-bit ints; ``ts`` is fixed (1.0,
2.0...) instead of the publisher's ``time.time()`` so the bytes are reproducible. The committed copy used by
the unit tests is ``tests/unit/data/vllm_offload_sequence.hex`` (one payload per line);
``python -m tests.engines.vllm_offload_events`` prints it.

Another vLLM release's events without installing it (a CUDA wheel does not import on the CPU build):
``--vllm-src DIR`` loads ``OVERLAY_MODULES`` from DIR (the release's unpacked wheel) in place of the installed
ones, before anything imports them; the rest comes from the installed vLLM. That is exact only when the rest
of the code these events go through is the same in both releases. It is for vLLM 0.33 over the installed
0.32: of that code, 0.33 changes only those three modules (``BlockStored.lookahead_token_ids``,
``OffloadingEvent.metadata_only``, the tracker's group specs and primary residency on lookups), and
``BlockPool`` differs only with lookahead hashing, off by default. ``tests/unit/data/vllm033_offload_sequence.hex``
is ``python -m tests.engines.vllm_offload_events --vllm-src DIR`` with the vllm-0.33.0 wheel unpacked in DIR.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

PAGE = 32  # vLLM's block size (the CPU build's default)
PAGES_PER_CHUNK = 2  # the offloading connector's chunk: kv_connector_extra_config block_size 64
STORAGE_OWNERSHIP = "kvcr"
# the modules that define these events' shapes and the connector's translation (``--vllm-src``)
OVERLAY_MODULES = (
    "vllm.distributed.kv_events",
    "vllm.v1.kv_offload.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events",
)


def use_vllm_source(src: str) -> None:
    """Load ``OVERLAY_MODULES`` from the vLLM source tree ``src`` in place of the installed ones."""
    for name in OVERLAY_MODULES:
        parent, _, child = name.rpartition(".")
        package = importlib.import_module(parent)
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the overlay: its users keep the installed one")
        spec = importlib.util.spec_from_file_location(name, Path(src, *name.split(".")).with_suffix(".py"))
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{name} not found under {src}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(package, child, module)


def offload_sequence_payloads() -> list[bytes]:
    """The six payloads described in the module docstring, from the installed vLLM."""
    import msgspec
    import torch
    from vllm.distributed import kv_events
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
        get_offloading_event_group_spec,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import block_pool
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    from vllm.v1.kv_offload.base import (
        Locality,
        Medium,
        OffloadingEvent,
        OffloadingKVEventsConfig,
        make_offload_key,
    )
    from vllm.v1.request import Request

    assert block_pool.BlockStored is kv_events.BlockStored  # with --vllm-src too: the pool publishes its events
    init_none_hash(sha256_cbor)
    n_pages = PAGES_PER_CHUNK
    prompt = list(range(1000, 1000 + n_pages * PAGE + 1))  # the last token is not in a full page
    req = Request(
        "offload-0",
        prompt,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(PAGE, sha256_cbor),
    )
    assert len(req.block_hashes) == n_pages

    pool = BlockPool(n_pages + 4, enable_caching=True, hash_block_size=PAGE, enable_kv_cache_events=True)
    pages = pool.get_new_blocks(n_pages + 1)

    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=8, dtype=torch.float16)
    group = GroupOffloadConfig(
        group_idx=0,
        tokens_per_block=PAGE,
        tokens_per_chunk=PAGE * PAGES_PER_CHUNK,
        hashes_per_chunk=PAGES_PER_CHUNK,
        kv_event_group_spec=get_offloading_event_group_spec(KVCacheGroupSpec(["layers.0.attn"], spec)),
        sliding_window_size_in_chunks=None,
        kv_cache_spec=spec,
        manager_cls=KVCacheSpecRegistry.get_manager_class(spec),
    )
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    )
    key = make_offload_key(req.block_hashes[PAGES_PER_CHUNK - 1], 0)  # a chunk's key: its last page's hash
    storage = {
        "medium": Medium.STORAGE,
        "locality": Locality.LOCAL,
        "ownership": STORAGE_OWNERSHIP,
        "removal_expected": True,
    }

    batches: list[list[object]] = []
    # 1. the GPU pages are computed and cached
    pool.cache_full_blocks(req, pages, 0, n_pages, PAGE, 0)
    batches.append(list(pool.take_events()))
    # 2. the connector's store job to the CPU tier completes
    tracker.record_store(req, group, 0, key)
    batches.append(list(tracker.take_events([OffloadingEvent(keys=[key], medium=Medium.CPU, removed=False)])))
    # 3. the chunk reaches the STORAGE tier
    batches.append(list(tracker.take_events([OffloadingEvent(keys=[key], removed=False, **storage)])))
    # 4. the request ends and other requests reuse its GPU pages
    pool.free_blocks(reversed(pages))
    pool.get_new_blocks(pool.get_num_free_blocks())
    batches.append(list(pool.take_events()))
    # 5. the STORAGE tier drops the chunk
    batches.append(list(tracker.take_events([OffloadingEvent(keys=[key], removed=True, **storage)])))
    # 6. the CPU tier evicts it
    batches.append(list(tracker.take_events([OffloadingEvent(keys=[key], medium=Medium.CPU, removed=True)])))

    encoder = msgspec.msgpack.Encoder()
    return [encoder.encode(KVEventBatch(ts=float(i + 1), events=ev)) for i, ev in enumerate(batches)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", help="a vLLM source tree whose OVERLAY_MODULES replace the installed ones")
    args = parser.parse_args()
    if args.vllm_src:
        use_vllm_source(args.vllm_src)
    for payload in offload_sequence_payloads():
        print(payload.hex())
