"""The ``vllm serve`` command lines of the real-engine tier: P/D engines get the shared-storage connector and
prefill every prompt in one step; every other engine's command is what it was (no engine is started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.vllm_engine.process import KvTransfer, VllmConfig, VllmProcess


def command(cfg: VllmConfig) -> list[str]:
    return VllmProcess(cfg, Path("/models/tiny")).command()


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_an_engine_without_a_connector_has_no_transfer_flags() -> None:
    cmd = command(VllmConfig(num_gpu_blocks=384))
    assert "--kv-transfer-config" not in cmd
    assert "--no-enable-chunked-prefill" not in cmd
    assert "--max-num-batched-tokens" not in cmd
    assert flag(command(VllmConfig(max_num_batched_tokens=2048)), "--max-num-batched-tokens") == "2048"


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_pd_engine_gets_the_example_connector_and_no_chunked_prefill(role: str, tmp_path: Path) -> None:
    cfg = VllmConfig(block_size=32, num_gpu_blocks=256, kv_transfer=KvTransfer(role, tmp_path))  # type: ignore[arg-type]
    cmd = command(cfg)
    assert json.loads(flag(cmd, "--kv-transfer-config")) == {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    assert "--no-enable-chunked-prefill" in cmd
    # the budget is the longest prompt the engine accepts: 255 pages of 32 (one page is reserved)
    assert flag(cmd, "--max-model-len") == flag(cmd, "--max-num-batched-tokens") == str(255 * 32)


def test_a_pd_engine_refuses_a_budget_below_its_longest_prompt(tmp_path: Path) -> None:
    small = VllmConfig(num_gpu_blocks=256, max_num_batched_tokens=2048, kv_transfer=KvTransfer("kv_consumer", tmp_path))
    with pytest.raises(ValueError, match="max-num-batched-tokens >= max_model_len"):
        command(small)
    bigger = VllmConfig(
        num_gpu_blocks=256, max_num_batched_tokens=9000, kv_transfer=KvTransfer("kv_consumer", tmp_path)
    )
    assert flag(command(bigger), "--max-num-batched-tokens") == "9000"
