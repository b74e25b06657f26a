"""Build a LoRA adapter for the tiny model offline, deterministically, and cache it beside the model.

The real-engine tier checks that the picker learns a base model and its adapters from vLLM's own ``/v1/models``
and reads ``vllm:lora_requests_info`` (docs/real-engines.md, "LoRA"). No adapter can be downloaded here, so one is
written by hand in PEFT's on-disk format: ``adapter_config.json`` (rank, alpha, target modules) and
``adapter_model.safetensors`` with small seeded random ``lora_A``/``lora_B`` weights for every layer's
``q_proj`` and ``v_proj``. Its effect on the answers is noise, as the model's own; what is real is the engine
loading it, listing it with its ``parent`` and scheduling requests for it.

This module runs inside the engines' virtual environment (torch and safetensors come with vLLM)::

    .venv-engines/bin/python -m benchmarks.vllm_engine.lora MODEL_DIR [--name NAME] [--rank 8]
    # prints the adapter directory
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RANK = 8  # at most vLLM's --max-lora-rank (default 16)
TARGETS = ("q_proj", "v_proj")


def build(model_dir: Path, name: str = "kv-epp-tiny-lora", rank: int = RANK, seed: int = 7) -> Path:
    """The adapter's directory under ``model_dir`` (``lora-<name>-r<rank>``), written first when absent."""
    import torch
    from safetensors.torch import save_file  # type: ignore[import-not-found]  # in .venv-engines only

    out = model_dir / f"lora-{name}-r{rank}"
    if (out / "adapter_model.safetensors").is_file():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    out_dims = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[target], rank, generator=gen) * 0.01
    scratch = out.with_name(out.name + ".tmp")
    scratch.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(scratch / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (scratch / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    scratch.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_engine.lora", description=__doc__)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--name", default="kv-epp-tiny-lora")
    ap.add_argument("--rank", type=int, default=RANK)
    a = ap.parse_args(argv)
    print(build(a.model_dir, a.name, a.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
