"""The simulator's one typed configuration object; every default lives here and CLI flags derive from it.

Timing model (continuous batching, see ``scheduler.py``): each scheduler step costs
``step_overhead_ms + prefill_ms_per_token * prefill_tokens + decode_ms_per_seq * decoding_seqs``
simulated milliseconds (plus ``transfer_ms_per_token`` per token a synchronous connector loads in it) and
really sleeps that times ``time_scale`` (0.1 = ten times faster than real).

KV transfer (prefill/decode disaggregation, see ``kv_transfer.py``): ``kv_connector`` and ``kv_role`` are vLLM's
``--kv-transfer-config`` ``kv_connector`` / ``kv_role``: ``nixl`` speaks NixlConnector's ``kv_transfer_params``,
``shared-storage`` is ExampleConnector's shared directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args, get_origin

from benchmarks.engine_sim.kv_events import KvEventsSettings


def _f(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True, frozen=True)
class SimConfig:
    """One simulated vLLM replica."""

    name: str = _f("sim-0", "replica name, sent back in the x-kv-sim-name response header")
    model: str = _f("sim-model", "served model name (/v1/models, metrics label model_name)")
    host: str = _f("127.0.0.1", "HTTP bind address")
    port: int = _f(0, "HTTP port (0: pick a free one)")
    block_size: int = _f(16, "tokens per KV block")
    capacity_blocks: int = _f(8192, "KV blocks on the (simulated) GPU")
    max_model_len: int = _f(32768, "longest prompt + output accepted")
    max_num_seqs: int = _f(64, "most requests running at once")
    max_num_batched_tokens: int = _f(2048, "token budget per scheduler step (chunked prefill)")
    step_overhead_ms: float = _f(2.0, "fixed cost of one scheduler step")
    prefill_ms_per_token: float = _f(0.1, "cost per uncached prompt token")
    decode_ms_per_seq: float = _f(0.5, "cost per decoding sequence per step")
    time_scale: float = _f(1.0, "real seconds per simulated second (0.1 = ten times faster)")
    default_max_tokens: int = _f(16, "output length when a request sets no max_tokens")
    hash_seed: str = _f("", "seed of the engine block hash (like PYTHONHASHSEED)")
    lora_adapters: str = _f("", "comma-separated LoRA adapter names served besides the model")
    max_loras: int = _f(4, "LoRA adapter slots (vllm:lora_requests_info's max_lora, with lora_adapters)")
    error_rate: float = _f(0.0, "fraction of requests answered with HTTP 500 (fault)")
    event_drop_rate: float = _f(0.0, "fraction of KV event batches not sent on PUB (fault)")
    seed: int = _f(0, "seed of the fault random generators")
    kv_events_enabled: bool = _f(True, "publish KV events over ZMQ")
    stream_headers: Literal["admitted", "first_token"] = _f(
        "admitted",
        "when a streamed response's headers go out: admitted (as vLLM and SGLang: a StreamingResponse starts "
        "before the engine has the request, so before prefill) or first_token",
    )
    engine_label: str = _f("0", "metrics label engine")
    kv_connector: Literal["none", "nixl", "shared-storage"] = _f(
        "none",
        "KV connector (vLLM's --kv-transfer-config kv_connector): none; nixl (NixlConnector: a request's "
        "kv_transfer_params); shared-storage (ExampleConnector: prompts' KV in kv_shared_storage_path)",
    )
    kv_role: Literal["both", "producer", "consumer"] = _f(
        "both",
        "vLLM's kv_role (kv_both, kv_producer, kv_consumer): a producer prefills for others (answers "
        "do_remote_decode, writes the shared directory), a consumer loads their KV (do_remote_prefill, reads it)",
    )
    transfer_ms_per_token: float = _f(0.02, "cost per KV token loaded through the connector (simulated ms)")
    kv_transfer_timeout_s: float = _f(
        480.0,
        "nixl: simulated seconds a producer holds a finished prefill's blocks for the consumer to read "
        "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
    )
    kv_load_failure_policy: Literal["fail", "recompute"] = _f(
        "fail", "a KV load that fails: fail the request (HTTP 500, vLLM's default) or recompute the prompt locally"
    )
    kv_side_channel_host: str = _f("", "nixl: the remote_host this engine announces (empty: host)")
    kv_shared_storage_path: str = _f("", "shared-storage: the directory shared by producers and consumers")
    kv_shared_storage_max_entries: int = _f(
        4096, "shared-storage: prompts this engine keeps written there (its oldest is deleted past it)"
    )


T = TypeVar("T")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type[Any], prefix: str = "") -> None:
    """Add one ``--flag`` per field of dataclass ``cls`` (help from field metadata)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + prefix + f.name.replace("_", "-")
        hint = hints[f.name]
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": prefix.replace("-", "_") + f.name, "default": f.default}
        args = get_args(hint)
        optional = get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
            continue
        if get_origin(base) is Literal:
            kwargs["choices"] = list(get_args(base))
            kwargs["type"] = str
        else:
            kwargs["type"] = base
        if optional:
            help_text += " (empty: none)"
            inner = kwargs["type"]
            kwargs["type"] = lambda s, inner=inner: None if s == "" else inner(s)
        parser.add_argument(flag, help=f"{help_text} (default: {f.default!r})", **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace, prefix: str = "") -> T:
    """Build dataclass ``cls`` from the flags added by ``add_dataclass_arguments``."""
    dest = prefix.replace("-", "_")
    values = {f.name: getattr(ns, dest + f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**values)


__all__ = ["KvEventsSettings", "SimConfig", "add_dataclass_arguments", "from_namespace"]
