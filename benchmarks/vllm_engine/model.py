"""Build the real-engine tier's tiny Llama offline, deterministically, and cache it on disk.

No model can be downloaded on the machines this project runs on, so the real vLLM engines serve a model
built here in seconds: ``transformers``' ``LlamaForCausalLM`` with seeded random weights and a byte-level
BPE tokenizer trained with ``tokenizers`` on source files that ship with Python (a fixed, sorted list of
standard-library modules), wrapped as a ``PreTrainedTokenizerFast`` with a chat template. Its answers are
noise; its prefill and decode costs, its tokenizer, its chat template and its KV cache are real.

The shape makes prefill dominate, as on a GPU (docs/real-engines.md): hidden 256, 4 layers, 4 heads, 2 KV
heads (``SPEC``). The directory's name holds a hash of the spec and the Python version (the corpus is that Python's
standard library), so a changed spec builds a new model and an unchanged one is reused.

This module runs inside the engines' virtual environment (``.venv-engines``, where torch, transformers and
tokenizers are installed with vLLM); the main environment only calls it as a subprocess::

    .venv-engines/bin/python -m benchmarks.vllm_engine.model [--cache DIR]   # prints the model directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

# What the model is; changing any of it changes the directory name, so a cached model is never stale.
SPEC: dict[str, Any] = {
    "name": "kv-epp-tiny-llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "vocab_size": 8192,
    "seed": 20,
    # the tokenizer's training text: these standard-library modules, in this order
    "corpus": [
        "argparse.py", "ast.py", "asyncio/base_events.py", "collections/__init__.py", "configparser.py",
        "dataclasses.py", "datetime.py", "decimal.py", "email/message.py", "enum.py", "functools.py",
        "http/client.py", "inspect.py", "json/decoder.py", "logging/__init__.py", "pathlib.py", "pickle.py",
        "random.py", "shutil.py", "socket.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
        "textwrap.py", "threading.py", "typing.py", "unittest/case.py", "urllib/parse.py", "heapq.py",
    ],
    "template_version": 1,
}  # fmt: skip

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A plain chat template: each message between its role marker and <|end|>, then the assistant's marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
DEFAULT_CACHE = Path(os.environ.get("KV_EPP_CACHE", Path.home() / ".cache" / "kv-epp")) / "models"


def spec_id(spec: dict[str, Any] = SPEC) -> str:
    """The spec's hash, with the Python version (its standard library is the tokenizer's corpus)."""
    blob = json.dumps({**spec, "python": sys.version_info[:2]}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def model_dir(cache: Path = DEFAULT_CACHE, spec: dict[str, Any] = SPEC) -> Path:
    return cache / f"{spec['name']}-{spec_id(spec)}"


def _corpus(spec: dict[str, Any]) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in spec["corpus"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"standard-library files missing for the tokenizer corpus: {missing}")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def _build_tokenizer(spec: dict[str, Any], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=spec["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_model(spec: dict[str, Any], out: Path, vocab: int, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)


def build(cache: Path = DEFAULT_CACHE, spec: dict[str, Any] = SPEC) -> Path:
    """The model directory, built first when absent (written to a scratch directory, then renamed)."""
    final = model_dir(cache, spec)
    if (final / "config.json").is_file() and (final / "tokenizer.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the BPE trainer's merges do not depend on threads
    scratch = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=cache))
    try:
        _build_tokenizer(spec, scratch)
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(scratch)
        ids = tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"])
        _build_model(spec, scratch, len(tok), *ids)
        (scratch / "kv-epp-spec.json").write_text(json.dumps({**spec, "id": spec_id(spec)}, indent=1))
        try:
            os.rename(scratch, final)
        except OSError:  # another builder won the race: its model is the same
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_engine.model", description=__doc__)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where models are kept (KV_EPP_CACHE)")
    a = ap.parse_args(argv)
    print(build(a.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
