"""Continuous-batching scheduler: the simulator's timing model, run as one asyncio loop.

Each step (vLLM V1 style, first come first served):

1. Every running request past its prefill decodes one token (one budget token each).
2. Running requests still in prefill take the next chunk of their uncached prompt from the step's
   token budget (``max_num_batched_tokens``): chunked prefill.
3. Waiting requests are admitted in arrival order while a sequence slot (``max_num_seqs``), budget and
   KV slots are free; admission looks up the prefix cache (that is when ``prefix_cache_queries`` and
   ``prefix_cache_hits`` grow) and starts their prefill in the same step. A request that does not fit
   blocks the queue behind it (no reordering), as in vLLM.
4. The step sleeps ``step_duration_ms`` (``step_overhead_ms + prefill_ms_per_token * prefill_tokens +
   decode_ms_per_seq * decoding_seqs``, plus ``transfer_ms_per_token`` per token a synchronous connector
   loads in it) times ``time_scale``; then tokens are emitted. A request whose prefill completed in
   this step stores its full prompt blocks and emits its first token, so TTFT = queueing + the steps
   spent on its uncached prompt. Evictions and stores of the step are published as one event batch.

So a prefill stalls the streams decoding beside it, as in vLLM's continuous batching with chunked prefill:
decode tokens go first, but the step that carries them also carries up to ``max_num_batched_tokens`` of
prefill, and lasts as long as its tokens take, so the running streams' inter-token latency spikes for every
prefill chunk scheduled on their replica. ``kv_sim_steps_total``, ``kv_sim_decode_steps_with_prefill_total``
and ``kv_sim_prefill_tokens_in_decode_steps_total`` count it. Prefill/decode disaggregation moves the prefill
elsewhere (``kv_transfer.py``: a request whose KV is loaded asynchronously waits outside the batch and costs
the running streams no step time).

KV slots are reserved for prompt + max_tokens at admission, so there is no preemption for space
(``num_preemptions_total`` grows only through ``reset_prefix_cache(reset_running_requests=True)``).

Utility calls (``reset_prefix_cache``) run between steps, as vLLM's engine core runs them between two
``step()`` calls: one made while a step is in flight waits for that step to end (its outputs delivered
and its events published) and runs before the next step is planned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import (
    AllBlocksClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    KvEvent,
    KvEventPublisher,
)
from benchmarks.engine_sim.kv_transfer import (
    HeldTransfer,
    HeldTransfers,
    KvTransferParams,
    RemoteKv,
    SharedStorage,
    nixl_computed_tokens,
)
from benchmarks.engine_sim.prefix_cache import Allocation, PagedPrefixCache
from benchmarks.engine_sim.tokenizer import output_word

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class StepOutput:
    """One item a request's consumer reads: a generated token, the end, or a failure (with its HTTP status)."""

    kind: Literal["token", "done", "error"]
    text: str = ""
    status: int = 503


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation request inside the scheduler."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    digests: list[bytes] = field(default_factory=list)
    lora_name: str | None = None  # the LoRA adapter targeted (the request's model)
    cache_salt: str | None = None
    # bound: max_tokens token items + one done/error item, all produced by the scheduler
    outputs: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    arrival: float = 0.0
    scheduled_at: float = 0.0  # first admitted to the running set (0: not yet)
    first_token_at: float = 0.0  # its first output token (0: not yet)
    alloc: Allocation | None = None
    cached_tokens: int = 0
    prefill_remaining: int = 0
    chunk: int = 0
    generated: int = 0
    preemptions: int = 0  # times preempted (by reset_prefix_cache); a preempted request recomputes
    finished: bool = False
    aborted: bool = False
    kv_params: KvTransferParams | None = None  # its kv_transfer_params (read only with a KV connector)
    external_tokens: int = 0  # prompt tokens loaded through the KV connector instead of computed
    load_tokens: int = 0  # of which loaded synchronously in the step that schedules it (shared storage)
    store_external: bool = False  # shared storage: write its KV when its prefill completes
    kv_transfer_out: dict[str, Any] | None = None  # the kv_transfer_params of its answer (nixl producer)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters behind /metrics (kept across simulated restarts)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
    preemptions: int = 0  # running requests preempted by reset_prefix_cache(reset_running_requests=True)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0  # finished_reason="length"
    requests_aborted: int = 0  # finished_reason="abort"
    restarts: int = 0
    # per finished request that got its first token, as vLLM records them when the request finishes:
    # vllm:request_prefill_time_seconds (first scheduled → first token) and
    # vllm:request_prefill_kv_computed_tokens (prompt − cached), their _sum and _count
    prefill_requests: int = 0
    prefill_seconds: float = 0.0
    prefill_computed_tokens: int = 0
    # steps, and those in which running streams decoded beside prefill tokens (their tokens waited for it)
    steps: int = 0
    decode_steps_with_prefill: int = 0
    prefill_tokens_in_decode_steps: int = 0
    # the KV connector, as vLLM counts it: the lookups (prompt tokens not cached locally / found externally)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_loads: int = 0  # loads completed (nixl: reads from a producer; shared storage: loads from the directory)
    kv_load_failures: int = 0
    kv_tokens_written: int = 0  # shared storage: tokens written to the directory
    kv_transfers_held: int = 0  # nixl producer: finished prefills whose blocks were held for a consumer


def step_duration_ms(cfg: SimConfig, prefill_tokens: int, decoding_seqs: int, loaded_tokens: int = 0) -> float:
    """The simulated duration of one step: its tokens' cost (vLLM's forward pass grows with the batch)."""
    return (
        cfg.step_overhead_ms
        + cfg.prefill_ms_per_token * prefill_tokens
        + cfg.decode_ms_per_seq * decoding_seqs
        + cfg.transfer_ms_per_token * loaded_tokens
    )


class RequestRejected(ValueError):
    """A request the engine can never run (too long for the model or the KV capacity)."""


class BatchScheduler:
    """Runs the step loop over one ``PagedPrefixCache``; publishes KV events when given a publisher.

    Waiting queue bound: none of its own; the HTTP server's connection count bounds it (each waiting
    request is an open HTTP request). Running set bound: ``max_num_seqs``.
    """

    def __init__(
        self,
        config: SimConfig,
        cache: PagedPrefixCache,
        publisher: KvEventPublisher | None = None,
        remote: RemoteKv | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.publisher = publisher
        self.counters = EngineCounters()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        # the KV connector (kv_transfer.py): roles, NIXL's held blocks and loads, the shared directory
        connector = config.kv_connector
        self.produces = connector != "none" and config.kv_role in ("producer", "both")
        self.consumes = connector != "none" and config.kv_role in ("consumer", "both")
        self.engine_id = f"{config.name}-{uuid.uuid4().hex[:12]}"
        self.side_channel: tuple[str, int] = (config.kv_side_channel_host or config.host, config.port)
        self.shared_storage = (
            SharedStorage(
                config.kv_shared_storage_path, config.block_size, config.kv_shared_storage_max_entries, config.name
            )
            if connector == "shared-storage"
            else None
        )
        self.held = HeldTransfers(
            config.kv_transfer_timeout_s * config.time_scale,
            lambda delay, callback: asyncio.get_running_loop().call_later(delay, callback),
        )
        self.remote = remote if remote is not None else RemoteKv(config.name) if connector == "nixl" else None
        # requests loading their KV from a producer (vLLM's WAITING_FOR_REMOTE_KVS); bound: each holds KV slots
        self._loading: dict[SimRequest, asyncio.Task[None]] = {}
        self._releases: set[asyncio.Task[None]] = set()  # producers told of an abort; bound: the aborts in flight
        self._next_block_id = 1  # the block ids a producer announces (the simulator has no physical blocks)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stall_s = 0.0
        self._generation = 0  # bumped by restart(); a step from an older generation is discarded
        self._pending_events: list[KvEvent] = []  # vLLM's BlockPool.kv_event_queue: published by the next step
        self._in_step = False  # a step is planned and not yet applied
        # utility calls made during a step, run when it ends; bound: one per HTTP request waiting on it
        self._utility_calls: deque[tuple[Callable[[], bool], asyncio.Future[bool]]] = deque()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kv-sim-scheduler")

    async def stop(self) -> None:
        """Stop the loop and fail whatever is still queued or running."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._in_step = False
        self._fail_all("engine stopped")
        self.held.clear()
        if self.remote is not None:
            await self.remote.close()
        while self._utility_calls:
            _, future = self._utility_calls.popleft()
            if not future.done():
                future.set_exception(RuntimeError("engine stopped"))

    # -- request side ------------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected when a request could never be scheduled."""
        total = prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, "
                f"you requested {total} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        if self.cache.slots_needed(total) > self.cache.capacity_blocks:
            raise RequestRejected(f"request needs {total} tokens of KV cache, more than the engine holds")

    def submit(self, request: SimRequest) -> None:
        """Queue a request (call ``check`` first)."""
        request.arrival = time.monotonic()
        namespace = (
            "" if not (request.lora_name or request.cache_salt) else f"{request.lora_name}\x00{request.cache_salt}"
        )
        request.digests = self.cache.block_hashes(request.prompt_ids, namespace)
        self.waiting.append(request)
        self._wakeup.set()

    @property
    def num_waiting(self) -> int:
        """vLLM's ``num_requests_waiting``: the queue and the requests loading their KV."""
        return len(self.waiting) + len(self._loading)

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request's slots at the next step (at once when not running)."""
        if request.finished:
            return
        request.aborted = True
        if request in self.waiting:
            self.waiting.remove(request)
            self._finish(request, aborted=True)
            self._release_remote(request)  # aborted before it was scheduled: vLLM tells the producer too
        elif request in self._loading:
            self._loading.pop(request).cancel()
            self._finish(request, aborted=True)
            self._release_remote(request)

    def _release_remote(self, request: SimRequest) -> None:
        """A request that was to read a producer's blocks and never will: the producer frees them now, not at its
        timeout (vLLM's NixlConnector notifies it with no blocks read). The task is kept until it is done."""
        if self.remote is None or request.kv_params is None or not request.kv_params.remote_prefill:
            return
        task = asyncio.get_running_loop().create_task(self.remote.done(request.kv_params))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def stall(self, ms: float) -> None:
        """Fault switch: pause the step loop for ``ms`` real milliseconds before its next step."""
        self._stall_s += max(0.0, ms) / 1000.0
        self._wakeup.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache`` (v1/core/sched/scheduler.py), run between steps.

        Without ``reset_running_requests`` the cache is emptied only when no running request holds a
        slot; otherwise nothing changes and False is returned (vLLM's ``BlockPool.reset_prefix_cache``
        refuses while blocks are not freed). With it, every running request is first preempted back to
        the head of the waiting queue in arrival order (its slots freed, its prompt and output so far
        recomputed when readmitted), so the reset succeeds. On success ``AllBlocksCleared`` is queued and
        goes out with the next step's event batch: an idle engine publishes nothing until it serves
        another request. Prometheus counters are untouched (vLLM resets only its logged hit-rate window)."""
        return await self._between_steps(lambda: self._reset_prefix_cache(reset_running_requests))

    async def _between_steps(self, call: Callable[[], bool]) -> bool:
        if not self._in_step:
            return call()
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._utility_calls.append((call, future))
        return await future

    def _run_utility_calls(self) -> None:
        while self._utility_calls:
            call, future = self._utility_calls.popleft()
            if future.done():
                continue
            try:
                future.set_result(call())
            except Exception as exc:  # handed to the caller, as vLLM returns a utility call's failure
                future.set_exception(exc)

    def _reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        # vLLM frees an aborted request's blocks when it handles the abort, before any later utility call
        for r in self.running:
            if r.aborted:
                self._finish(r, aborted=True)
        self.running = [r for r in self.running if not r.finished]
        if reset_running_requests:
            while self.running:  # from the back, each to the front: the waiting queue keeps their order
                self._preempt(self.running.pop())
        if not self.cache.reset_prefix_cache():
            if reset_running_requests:
                raise RuntimeError("Failed to reset KV cache even when all the running requests are preempted")
            log.warning("prefix_cache_reset_failed name=%s held_slots=%d", self.config.name, self.cache.held_slots)
            return False
        if self.publisher is not None:
            self._pending_events.append(AllBlocksClearedEvent())
        log.info("prefix_cache_reset name=%s", self.config.name)
        return True

    def _preempt(self, r: SimRequest) -> None:
        """vLLM's ``_preempt_request``: free the request's slots and queue it first; it is readmitted
        with no computed tokens, its reported cached tokens kept from its first admission."""
        if r.alloc is not None:
            self.cache.release(r.alloc)
            r.alloc = None
        r.prefill_remaining = 0
        r.chunk = 0
        r.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(r)

    async def restart(self) -> None:
        """Simulated engine restart: fail all requests, clear the cache, reset the event sequence,
        and publish ``AllBlocksCleared`` as seq 0."""
        self._generation += 1
        self.counters.restarts += 1
        self._fail_all("engine restarted")
        self.held.clear()
        self.cache.clear()
        self._pending_events.clear()
        if self.publisher is not None:
            self.publisher.reset_sequence()
            await self.publisher.publish([AllBlocksClearedEvent()])
        log.info("engine_restarted name=%s", self.config.name)

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.config
        while True:
            self._in_step = False
            self._run_utility_calls()
            if self._stall_s > 0:
                stall, self._stall_s = self._stall_s, 0.0
                log.info("scheduler_stalled ms=%.0f", stall * 1000)
                await asyncio.sleep(stall)
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            generation = self._generation
            self._in_step = True
            decoding, prefill_tokens, loaded_tokens = self._plan_step()
            step_ms = step_duration_ms(cfg, prefill_tokens, len(decoding), loaded_tokens)
            self.counters.steps += 1
            if decoding and prefill_tokens:
                self.counters.decode_steps_with_prefill += 1
                self.counters.prefill_tokens_in_decode_steps += prefill_tokens
            await asyncio.sleep(step_ms / 1000.0 * cfg.time_scale)
            if generation != self._generation:
                continue  # restarted mid-step: this step's work is void
            self._apply_step(decoding)
            if self._pending_events and self.publisher is not None:
                events, self._pending_events = self._pending_events, []
                await self.publisher.publish(events)
            self._pending_events.clear()

    def _plan_step(self) -> tuple[list[SimRequest], int, int]:
        """The step's decoding requests, prefill tokens and synchronously loaded tokens (admitting requests)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decoding = [r for r in self.running if r.prefill_remaining == 0 and not r.aborted]
        budget -= len(decoding)
        prefill_tokens = 0
        loaded_tokens = 0
        for r in self.running:
            r.chunk = 0
            if r.prefill_remaining > 0 and not r.aborted and budget > 0:
                r.chunk = min(r.prefill_remaining, budget)
                budget -= r.chunk
                prefill_tokens += r.chunk
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            head = self.waiting[0]
            if head.alloc is not None:  # its KV load is over (vLLM: back from WAITING_FOR_REMOTE_KVS)
                self.waiting.popleft()
                head.chunk = min(head.prefill_remaining, budget)
                budget -= head.chunk
                prefill_tokens += head.chunk
                self.running.append(head)
                continue
            evicted: list[bytes] = []
            alloc = self.cache.try_admit(head.prompt_ids, head.max_tokens, evicted, head.digests)
            if evicted:
                self._pending_events.append(BlockRemovedEvent(tuple(evicted)))
            if alloc is None:
                break
            self.waiting.popleft()
            head.alloc = alloc
            hit_tokens = alloc.hit_blocks * self.cache.block_size
            first = head.preemptions == 0
            # the KV connector is asked once, at the first admission (vLLM triggers one transfer per request)
            external, load_async = self._matched_external(head, hit_tokens) if first else (0, False)
            # a preempted request recomputes its output so far too; vLLM counts its lookup apart from
            # the prefix-cache counters and reports the cached tokens of its first admission
            if first:
                head.scheduled_at = time.monotonic()
                head.cached_tokens = hit_tokens + (0 if load_async else external)  # a load's: when it is over
                head.external_tokens = external
                self.counters.prefix_cache_queries += head.prompt_tokens
                self.counters.prefix_cache_hits += hit_tokens
                self.counters.prompt_tokens += head.prompt_tokens
                if self.consumes:
                    self.counters.external_prefix_cache_queries += head.prompt_tokens - hit_tokens
                    self.counters.external_prefix_cache_hits += external
            if load_async:
                self._loading[head] = asyncio.get_running_loop().create_task(self._remote_load(head, hit_tokens))
                continue
            head.load_tokens = external
            loaded_tokens += external
            head.prefill_remaining = head.prompt_tokens + head.generated - hit_tokens - external
            head.chunk = min(head.prefill_remaining, budget)
            budget -= head.chunk
            prefill_tokens += head.chunk
            self.running.append(head)
        return decoding, prefill_tokens, loaded_tokens

    # -- the KV connector --------------------------------------------------------------------------
    def _matched_external(self, r: SimRequest, hit_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: prompt tokens the connector can load beyond the local
        hits, and whether the load is asynchronous (nixl) or inside the step (shared storage)."""
        if self.shared_storage is not None:  # a producer writes what the directory lacks, a consumer loads it
            found = self.shared_storage.lookup(r.prompt_ids)
            r.store_external = self.produces and found == 0
            return (max(0, found - hit_tokens) if self.consumes else 0), False
        if self.consumes and r.kv_params is not None and r.kv_params.remote_prefill:
            count = r.prompt_tokens - hit_tokens
            if count > 0:
                return count, True
        return 0, False

    async def _remote_load(self, r: SimRequest, hit_tokens: int) -> None:
        """NIXL: read the prompt's KV from the producer (``transfer_ms_per_token`` x the tokens), then queue
        the request first to compute what is left; a failed read follows ``kv_load_failure_policy``."""
        cfg = self.config
        assert r.kv_params is not None and self.remote is not None
        generation = self._generation
        error = await self.remote.read(r.kv_params)
        if error is None:
            await asyncio.sleep(cfg.transfer_ms_per_token * r.external_tokens / 1000.0 * cfg.time_scale)
        await self.remote.done(r.kv_params)  # the producer frees its blocks (on failure too: nothing to keep)
        if generation != self._generation or r.finished:
            return
        self._loading.pop(r, None)
        if error is None:
            self.counters.kv_loads += 1
            r.cached_tokens = nixl_computed_tokens(r.prompt_tokens, self.cache.block_size)
        else:
            self.counters.kv_load_failures += 1
            log.warning("kv_load_failed name=%s request_id=%s error=%s", cfg.name, r.request_id, error)
            if cfg.kv_load_failure_policy == "fail":
                self._fail(r, 500, f"KV transfer from the prefill engine failed: {error}")
                return
            r.cached_tokens = hit_tokens
        r.prefill_remaining = r.prompt_tokens + r.generated - r.cached_tokens
        self.waiting.appendleft(r)
        self._wakeup.set()

    def _holds_for_remote_decode(self, r: SimRequest) -> bool:
        """NIXL producer: a finished (length-capped) ``do_remote_decode`` request keeps its blocks."""
        return (
            self.produces
            and self.config.kv_connector == "nixl"
            and r.kv_params is not None
            and r.kv_params.do_remote_decode
        )

    def _hold(self, r: SimRequest, alloc: Allocation) -> None:
        bs = self.cache.block_size
        n_blocks = -(-r.prompt_tokens // bs)
        block_ids = tuple(range(self._next_block_id, self._next_block_id + n_blocks))
        self._next_block_id += n_blocks
        host, port = self.side_channel
        r.kv_transfer_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": r.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
        }
        self.held.hold(HeldTransfer(r.request_id, r.prompt_tokens, block_ids, lambda: self.cache.release(alloc)))
        self.counters.kv_transfers_held += 1

    def _apply_step(self, decoding: list[SimRequest]) -> None:
        decoding_set = set(decoding)
        still_running: list[SimRequest] = []
        for r in self.running:
            if r.aborted:
                self._finish(r, aborted=True)
                continue
            if r in decoding_set:
                self._emit_token(r)
            elif r.chunk > 0:
                r.prefill_remaining -= r.chunk
                r.chunk = 0
                if r.prefill_remaining == 0:
                    self._store_prompt_blocks(r)
                    if r.store_external and self.shared_storage is not None:
                        self.counters.kv_tokens_written += self.shared_storage.write(r.prompt_ids)
                    if r.load_tokens:
                        self.counters.kv_loads += 1
                    self._emit_token(r)
            if r.generated >= r.max_tokens:
                self._finish(r, aborted=False)
            else:
                still_running.append(r)
        self.running = still_running

    def _store_prompt_blocks(self, r: SimRequest) -> None:
        assert r.alloc is not None
        for run in self.cache.commit_prompt_blocks(r.alloc, r.prompt_ids):
            self._pending_events.append(
                BlockStoredEvent(
                    run.digests, run.parent, run.token_ids, self.cache.block_size, r.lora_name, r.cache_salt
                )
            )

    def _emit_token(self, r: SimRequest) -> None:
        word = output_word(r.prompt_ids, r.generated)
        if r.generated == 0:
            r.first_token_at = time.monotonic()
        r.generated += 1
        self.counters.generation_tokens += 1
        r.outputs.put_nowait(StepOutput("token", word))

    def _finish(self, r: SimRequest, aborted: bool) -> None:
        if r.finished:
            return
        r.finished = True
        if r.alloc is not None:
            if not aborted and self._holds_for_remote_decode(r):
                self._hold(r, r.alloc)
            else:
                self.cache.release(r.alloc)
        if r.first_token_at > 0.0:
            self.counters.prefill_requests += 1
            self.counters.prefill_seconds += max(0.0, r.first_token_at - r.scheduled_at)
            self.counters.prefill_computed_tokens += r.prompt_tokens - r.cached_tokens
        if aborted:
            self.counters.requests_aborted += 1
        else:
            self.counters.requests_finished += 1
            r.outputs.put_nowait(StepOutput("done"))

    def _fail(self, r: SimRequest, status: int, reason: str) -> None:
        """End a request with an error answer (its slots freed)."""
        if r.finished:
            return
        r.finished = True
        if r.alloc is not None:
            self.cache.release(r.alloc)
        r.outputs.put_nowait(StepOutput("error", reason, status))

    def _fail_all(self, reason: str) -> None:
        for task in self._loading.values():
            task.cancel()
        for r in [*self.waiting, *self.running, *self._loading]:
            if not r.finished:
                r.finished = True
                r.outputs.put_nowait(StepOutput("error", reason))
        self._loading.clear()
        self.waiting.clear()
        self.running = []
