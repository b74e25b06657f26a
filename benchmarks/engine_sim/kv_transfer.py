"""vLLM's KV connectors as the simulator models them: prefill/decode disaggregation at scale.

Two connectors, chosen by ``SimConfig.kv_connector``, gated by ``SimConfig.kv_role`` (vLLM's ``kv_role``:
a producer prefills for others, a consumer loads their KV, both does both):

``nixl``: vLLM's NixlConnector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py).

- A request whose ``kv_transfer_params`` say ``do_remote_decode: true`` is prefilled as usual. When it
  finishes (length-capped), its blocks are not freed: they are held for the consumer to read, until it
  has read them or ``kv_transfer_timeout_s`` has passed (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s). The
  answer carries ``kv_transfer_params = {do_remote_prefill: true, do_remote_decode: false,
  remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size}``. A request
  that ends otherwise (aborted) holds nothing and carries no parameters.
- A request with ``do_remote_prefill: true`` and ``remote_block_ids`` pulls the prompt's KV instead of
  prefilling it: every prompt token not cached locally (``get_num_new_matched_tokens``), loaded
  asynchronously. Its slots are reserved at admission, it waits outside the running batch (vLLM's
  ``WAITING_FOR_REMOTE_KVS``: it costs the other streams no step time), the load takes
  ``transfer_ms_per_token`` x those tokens, then the request computes the one token left and decodes.
  ``cached_tokens`` is what vLLM reports after the load (``_update_waiting_for_remote_kv``): the request's
  blocks x block size, capped at the prompt and one less when that reaches the prompt, i.e. the prompt
  minus one token (local hits included).
- The simulator's side channel is its HTTP server (``remote_host``: ``kv_side_channel_host`` or ``host``;
  ``remote_port``: its HTTP port): the consumer asks the producer for the held request (``POST
  /sim/kv_transfer/read``) and tells it when the load is over (``POST /sim/kv_transfer/done``), which
  frees the producer's blocks, as NIXL's notification does. An unknown request (expired, never held, another
  engine id) is a failed load: ``kv_load_failure_policy`` fail (vLLM's default: the request fails, HTTP
  500) or recompute (prefill locally).
- Without ``remote_block_ids`` (or with ``do_remote_prefill`` on a non-consumer) the request prefills
  locally, as vLLM does.

``shared-storage``: vLLM's ExampleConnector (``shared_storage_path``; llm-d's sidecar calls it
``shared-storage``; docs/wire.md section 6 has it measured on real vLLM).

- A producer that prefills a prompt whose KV is not in the directory writes it: one small marker file per
  prompt, named by a hash of its first ``align(P)`` tokens, where ``align(n) = (n - 1) // block_size *
  block_size`` (whole pages, as ``align_to_block_size``). Bound: each engine keeps at most
  ``kv_shared_storage_max_entries`` markers it wrote and deletes its oldest past that.
- A consumer looks the prompt up under ``align(P - 1)`` tokens; when found it loads them instead of
  computing them, synchronously, inside the step that schedules the request (ExampleConnector loads in
  the forward pass): the step costs ``transfer_ms_per_token`` x the loaded tokens more. ``cached_tokens``
  is ``align(P - 1)``: 3,616 of a 3,621-token prompt with 32-token pages, as measured on real vLLM.

Both roles store the blocks they computed or loaded in their prefix cache and publish KV events for them,
as vLLM does. The external lookups are counted as vLLM counts them:
``vllm:external_prefix_cache_queries_total`` (prompt tokens not cached locally) and ``_hits_total``
(those loaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class KvTransferError(ValueError):
    """``kv_transfer_params`` a request sent that cannot be read (the message names the field)."""


@dataclass(slots=True, frozen=True)
class KvTransferParams:
    """The ``kv_transfer_params`` of a request, as NixlConnector reads them."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: tuple[int, ...] = ()
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> KvTransferParams | None:
        """The parameters of a request body's ``kv_transfer_params`` (None when absent or null)."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise KvTransferError("'kv_transfer_params' must be an object")
        return cls(
            do_remote_decode=_bool(raw, "do_remote_decode"),
            do_remote_prefill=_bool(raw, "do_remote_prefill"),
            remote_block_ids=_block_ids(raw.get("remote_block_ids")),
            remote_engine_id=_opt_str(raw, "remote_engine_id"),
            remote_request_id=_opt_str(raw, "remote_request_id"),
            remote_host=_opt_str(raw, "remote_host"),
            remote_port=_opt_port(raw.get("remote_port")),
        )

    @property
    def remote_prefill(self) -> bool:
        """A consumer's request that pulls its KV from a producer (NixlConnector needs the block ids)."""
        return self.do_remote_prefill and bool(self.remote_block_ids)


def _field(raw: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    """``raw[key]`` when present and of ``kind`` (None when absent or null); KvTransferError otherwise."""
    value = raw.get(key)
    if value is not None and not isinstance(value, kind):
        raise KvTransferError(f"'kv_transfer_params.{key}' must be {what}")
    return value


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    return bool(_field(raw, key, bool, "a boolean"))


def _opt_str(raw: Mapping[str, Any], key: str) -> str | None:
    value: str | None = _field(raw, key, str, "a string")
    return value


def _opt_port(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise KvTransferError("'kv_transfer_params.remote_port' must be a TCP port")
    return value


def _block_ids(value: Any) -> tuple[int, ...]:
    """A flat list of block ids, or one list per KV cache group (vLLM's hybrid allocator): flattened."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise KvTransferError("'kv_transfer_params.remote_block_ids' must be a list")
    out: list[int] = []
    for item in value:
        group = item if isinstance(item, list) else [item]
        for b in group:
            if isinstance(b, bool) or not isinstance(b, int):
                raise KvTransferError("'kv_transfer_params.remote_block_ids' must hold integers")
            out.append(b)
    return tuple(out)


# -- the token counts vLLM reports ---------------------------------------------------------------------
def nixl_computed_tokens(prompt_tokens: int, block_size: int) -> int:
    """The tokens a request counts as computed once NixlConnector has loaded its KV (vLLM's
    ``_update_waiting_for_remote_kv``): its blocks x block size, capped at the prompt, one less when that
    reaches the prompt (the last token is always computed)."""
    blocks = -(-prompt_tokens // block_size)
    computed = min(blocks * block_size, prompt_tokens)
    return computed - 1 if computed == prompt_tokens else computed


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """ExampleConnector's ``align_to_block_size``: ``(n - 1) // block_size * block_size`` (0 for n <= 0)."""
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // block_size * block_size


def shared_storage_load_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens ExampleConnector looks up (and loads): ``align(P - 1)``."""
    return align_to_block_size(prompt_tokens - 1, block_size)


def shared_storage_store_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens ExampleConnector writes: ``align(P)``."""
    return align_to_block_size(prompt_tokens, block_size)


# -- shared storage ------------------------------------------------------------------------------------
class SharedStorage:
    """ExampleConnector's directory: one marker file per written prompt prefix.

    Bound: this engine deletes the oldest marker it wrote once it has written ``max_entries`` (markers of
    other engines are theirs to bound; a marker deleted by another engine is simply a miss).
    """

    def __init__(self, path: str, block_size: int, max_entries: int, engine: str) -> None:
        if not path:
            raise ValueError("kv_connector shared-storage needs kv_shared_storage_path (a directory)")
        if max_entries <= 0:
            raise ValueError("kv_shared_storage_max_entries must be positive")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.max_entries = max_entries
        self.engine = engine
        self._written: deque[Path] = deque()  # bound: max_entries (the oldest marker is deleted first)
        self.writes = 0
        self.evictions = 0

    def marker(self, token_ids: Sequence[int]) -> Path:
        """The marker file of exactly these tokens (ExampleConnector hashes the token ids' bytes)."""
        digest = hashlib.sha256(struct.pack(f">{len(token_ids)}I", *token_ids)).hexdigest()
        return self.path / f"{digest}.json"

    def lookup(self, prompt_ids: Sequence[int]) -> int:
        """The prompt tokens the directory holds for this prompt: ``align(P - 1)`` or 0."""
        n = shared_storage_load_tokens(len(prompt_ids), self.block_size)
        if n <= 0:
            return 0
        return n if self.marker(prompt_ids[:n]).exists() else 0

    def write(self, prompt_ids: Sequence[int]) -> int:
        """Write the prompt's KV (its marker); returns the tokens written (0: too short to write)."""
        n = shared_storage_store_tokens(len(prompt_ids), self.block_size)
        if n <= 0:
            return 0
        path = self.marker(prompt_ids[:n])
        tmp = path.with_name(f".{path.name}.{self.engine}.tmp")
        tmp.write_text(json.dumps({"tokens": n, "engine": self.engine}))
        os.replace(tmp, path)
        self.writes += 1
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        while len(self._written) > self.max_entries:
            old = self._written.popleft()
            old.unlink(missing_ok=True)
            self.evictions += 1
        return n


# -- NIXL: the producer's held blocks ------------------------------------------------------------------
@dataclass(slots=True)
class HeldTransfer:
    """A finished prefill whose blocks wait for the consumer to read them."""

    request_id: str
    tokens: int
    block_ids: tuple[int, ...]
    release: Callable[[], None]  # frees the blocks in the producer's cache
    expiry: Any = None  # the asyncio TimerHandle that frees them at the timeout


class HeldTransfers:
    """The producer side of NixlConnector: request id -> held blocks.

    Bound: every held request holds at least one KV slot, so the cache's ``capacity_blocks`` bounds the
    table, and each entry is freed at the latest after ``timeout_s`` (real seconds) or when read.
    """

    def __init__(self, timeout_s: float, call_later: Callable[[float, Callable[[], None]], Any]) -> None:
        self.timeout_s = timeout_s
        self._call_later = call_later
        self._held: dict[str, HeldTransfer] = {}
        self.expired = 0
        self.read = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, held: HeldTransfer) -> None:
        """Keep ``held`` until it is read or times out."""
        self.release(held.request_id)  # a repeated id replaces the older entry
        held.expiry = self._call_later(self.timeout_s, lambda: self._expire(held.request_id))
        self._held[held.request_id] = held

    def get(self, request_id: str) -> HeldTransfer | None:
        return self._held.get(request_id)

    def done(self, request_id: str) -> bool:
        """The consumer has read the blocks: free them. False when nothing was held under that id."""
        if request_id not in self._held:
            return False
        self.read += 1
        return self.release(request_id)

    def release(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        if held.expiry is not None:
            held.expiry.cancel()
        held.release()
        return True

    def clear(self) -> None:
        """Forget every entry without freeing (the cache itself was cleared: engine restart)."""
        for held in self._held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self._held.clear()

    def _expire(self, request_id: str) -> None:
        if request_id in self._held:
            self.expired += 1
            log.warning("kv_transfer_expired request_id=%s timeout_s=%.1f", request_id, self.timeout_s)
            self.release(request_id)


# -- NIXL: the consumer's reads ------------------------------------------------------------------------
READ_PATH = "/sim/kv_transfer/read"
DONE_PATH = "/sim/kv_transfer/done"
PEER_TIMEOUT_S = 10.0  # one side-channel call; a producer that does not answer in time is a failed load


class RemoteKv:
    """The consumer's side channel to producers: their HTTP servers (``remote_host:remote_port``)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._http: aiohttp.ClientSession | None = None  # opened on first use (needs a running loop)

    async def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S))
        return self._http

    @staticmethod
    def _url(params: KvTransferParams, path: str) -> str:
        return f"http://{params.remote_host}:{params.remote_port}{path}"

    def _body(self, params: KvTransferParams) -> dict[str, Any]:
        return {
            "remote_request_id": params.remote_request_id,
            "remote_engine_id": params.remote_engine_id,
            "remote_block_ids": list(params.remote_block_ids),
            "reader": self.engine,
        }

    async def read(self, params: KvTransferParams) -> str | None:
        """Ask the producer for the held blocks; None when it has them, else why the load failed."""
        if not params.remote_host or params.remote_port is None or not params.remote_request_id:
            return "kv_transfer_params lack remote_host, remote_port or remote_request_id"
        try:
            http = await self._session()
            async with http.post(self._url(params, READ_PATH), json=self._body(params)) as resp:
                if resp.status == 200:
                    return None
                return f"producer answered {resp.status}: {(await resp.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"producer unreachable: {type(exc).__name__}: {exc}"

    async def done(self, params: KvTransferParams) -> None:
        """Tell the producer the blocks are read (it frees them); failures are logged, its timeout frees them."""
        if not params.remote_host or params.remote_port is None or not params.remote_request_id:
            return
        try:
            http = await self._session()
            async with http.post(self._url(params, DONE_PATH), json=self._body(params)) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("kv_transfer_done_failed request_id=%s error=%s", params.remote_request_id, exc)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
