"""vLLM KV-event batches as an engine's ZMQ publisher sends them: stored blocks (positional or map) in a
msgpack batch."""

from __future__ import annotations

from typing import Any

import msgpack

from listener.config import ListenerConfig

BS = 4
MODEL = "m"
TOKENS = list(range(1000, 1032))  # 8 blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int], as_map: bool = False) -> Any:
    if as_map:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": BS, "medium": "GPU"}  # fmt: skip
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None]


def batch(*events: Any) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


# -- keys over real sockets: the feed holds exactly the keys the picker computes ----------------------------------
# For what vLLM 0.33 and SGLang 0.5.23 publish (docs/wire.md §3-4), with the feed's default key block size (16).
KB = ListenerConfig().key_block_size  # the feed's default key block size: engines publish pages of their own
