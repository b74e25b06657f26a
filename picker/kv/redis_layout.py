"""The shared KV index's layout on Redis: one hash per backend (field: the block key, 8 bytes big-endian; value:
its tier), the backends' set, the Lua scripts that read a request's holds in one round trip and clear the index,
and the queued write ops the writer task sends. See docs/picker.md, "The KV index on Redis".
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from picker.config import KV_INDEX_KEY_PREFIX
from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

PACK = struct.Struct(">Q")

# The index's keys on a Valkey/Redis Cluster: one hash tag, so every key of the index (the backends' set, every
# backend's hash, a resync's temporary hash) is in ONE slot and the scripts and transactions below run there
# unchanged (docs/picker.md, "Redis modes: single, Sentinel, Cluster"). Single and Sentinel keep ``cr:kvidx:``.
CLUSTER_KEY_PREFIX = "cr:kvidx:{kvidx}:"


def index_key_prefix(mode: str) -> str:
    """The index's key prefix for a ``response_cache.redis.mode``."""
    return CLUSTER_KEY_PREFIX if mode == "cluster" else KV_INDEX_KEY_PREFIX


TIER = {StorageTier.GPU_HOT: b"g", StorageTier.STORAGE_WARM: b"w"}

# KEYS[1] the backends set; ARGV[1] the hash key prefix; ARGV[2] the request's block keys, 8 bytes each, in
# one string (one argument instead of one per block: 25% less time per call, measured at 196 blocks).
# Returns a flat list: backend, leading blocks held, 1 when all of them are GpuHot.
HOLDS_LUA = """
local names = redis.call('SMEMBERS', KEYS[1])
local blob = ARGV[2]
local n = #blob / 8
local out = {}
for _, name in ipairs(names) do
  local h = ARGV[1] .. name
  local run, gpu = 0, 1
  for i = 0, n - 1 do
    local t = redis.call('HGET', h, string.sub(blob, i * 8 + 1, i * 8 + 8))
    if not t then break end
    run = run + 1
    if t ~= 'g' then gpu = 0 end
  end
  if run > 0 then
    out[#out + 1] = name
    out[#out + 1] = run
    out[#out + 1] = gpu
  end
end
return out
"""

# KEYS[1] the backends set; ARGV[1] the hash key prefix: drop every backend's hash and the set
CLEAR_LUA = """
local names = redis.call('SMEMBERS', KEYS[1])
for _, name in ipairs(names) do redis.call('DEL', ARGV[1] .. name) end
redis.call('DEL', KEYS[1])
return #names
"""


# Cluster mode's write batch, the same effect as single mode's MULTI/EXEC of the same ops (atomic, one round trip,
# one slot: every key it touches carries the index's hash tag). Why not redis-py's cluster transaction pipeline:
# it resolves each queued command's slot in a new thread with a new event loop (redis-py 6.2-8.x), which blocks
# the picker's loop per command and leaves connections bound to a dead loop when it opens them.
# KEYS[1] the backends set; ARGV[1] the hash key prefix; ARGV[2] the TTL (ms); then per op three arguments:
# kind (p put, d del, x drop, c clear, t touch), backend, payload (put: the tier byte then the 8-byte block
# keys; del: the block keys; else empty).
APPLY_LUA = """
local set, hp, ttl = KEYS[1], ARGV[1], ARGV[2]
local function bulk(cmd, h, blob, from, tier)
  local args = {}
  for j = from, #blob, 8 do
    args[#args + 1] = string.sub(blob, j, j + 7)
    if tier then args[#args + 1] = tier end
    if #args >= 4000 then redis.call(cmd, h, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call(cmd, h, unpack(args)) end
end
for i = 3, #ARGV, 3 do
  local kind, name, blob = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local h = hp .. name
  if kind == 'p' then
    redis.call('SADD', set, name)
    bulk('HSET', h, blob, 2, string.sub(blob, 1, 1))
    redis.call('PEXPIRE', h, ttl)
    redis.call('PEXPIRE', set, ttl)
  elseif kind == 'd' then
    bulk('HDEL', h, blob, 1, nil)
  elseif kind == 'x' then
    redis.call('DEL', h)
    redis.call('SREM', set, name)
  elseif kind == 'c' then
    local names = redis.call('SMEMBERS', set)
    for _, n in ipairs(names) do redis.call('DEL', hp .. n) end
    redis.call('DEL', set)
  elseif kind == 't' then
    redis.call('PEXPIRE', h, ttl)
    redis.call('PEXPIRE', set, ttl)
  end
end
return 1
"""

# Cluster mode's end of a backend's resync (single mode: the same four commands in MULTI/EXEC).
# KEYS[1] the temporary hash, KEYS[2] the backend's hash, KEYS[3] the backends set; ARGV[1] backend, ARGV[2] TTL.
SWAP_LUA = """
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""

_APPLY_KIND = {"put": b"p", "del": b"d", "drop": b"x", "clear": b"c", "touch": b"t"}


def apply_args(batch: Sequence[WriteOp], hash_prefix: bytes, ttl_ms: int) -> list[bytes | int]:
    """``APPLY_LUA``'s arguments for a write batch."""
    out: list[bytes | int] = [hash_prefix, ttl_ms]
    for op in batch:
        payload = b""
        if op.kind == "put":
            payload = op.tier + pack_keys(op.keys)
        elif op.kind == "del":
            payload = pack_keys(op.keys)
        out += [_APPLY_KIND[op.kind], op.backend.encode(), payload]
    return out


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as one string of 8-byte big-endian fields (the script's argument)."""
    return struct.pack(f">{len(keys)}Q", *keys)


@dataclass(slots=True)
class WriteOp:
    kind: str  # put, del, drop, clear, touch
    backend: str = ""
    keys: list[int] = field(default_factory=list)
    tier: bytes = b""


@dataclass(slots=True)
class RedisIndexStats:
    """Counters for the admin stats and metrics (monotonic, except ``up`` and ``queued_keys``)."""

    up: bool = True  # reads go to Redis (False: answered locally until the writer's ping + resync)
    lookups: int = 0  # holds() answered by Redis
    fallbacks: int = 0  # holds() answered by the local index because Redis is down or failed
    errors: int = 0  # failed Redis calls (reads and writes)
    batches: int = 0  # MULTI/EXEC write batches sent
    ops_written: int = 0
    writes_dropped: int = 0  # ops dropped (queue full or Redis down): a resync follows
    resyncs: int = 0
    queued_keys: int = 0
    bad_replies: int = 0  # holds() replies that were not the script's shape (answered by the local index)


def parse_holds(flat: Any) -> dict[str, BackendHold]:
    """The holds script's flat reply (backend, leading blocks, 1 when all GpuHot) as holds; ValueError (and
    TypeError, IndexError) on anything else: a backend name that is not UTF-8 (our names are), a count that is
    not a non-negative integer. Anyone who can write to Redis can write there: its reply is input, not trusted."""
    if not isinstance(flat, list) or len(flat) % 3:
        raise ValueError("not a list of (backend, blocks, gpu) triples")
    out: dict[str, BackendHold] = {}
    for i in range(0, len(flat), 3):
        raw, blocks, gpu = flat[i], int(flat[i + 1]), int(flat[i + 2])
        name = raw.decode() if isinstance(raw, bytes) else str(raw)  # UnicodeDecodeError is a ValueError
        if blocks < 0:
            raise ValueError("a negative block count")
        out[name] = BackendHold(blocks, StorageTier.GPU_HOT if gpu else StorageTier.STORAGE_WARM)
    return out
