"""The offload sequence of issue 20, produced by the installed vLLM's own code (not a copy of its formats):
a block stored on GPU, CPU and STORAGE (``locality`` LOCAL), then removed from GPU and STORAGE, keeps its keys
as ``storage_warm`` in the listener while the CPU copy is left. The unit tests use the committed bytes
(``tests/unit/data/vllm_offload_sequence.hex``); this test proves they are what this vLLM publishes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.vllm_engine.process import ROOT, engines_python
from tests.support.offload_listener import CPU_REMOVAL, STORAGE_REMOVAL, Listener
from tests.support.offload_listener import offload_keys as keys

FIXTURE = Path(__file__).resolve().parents[1] / "unit" / "data" / "vllm_offload_sequence.hex"


def test_offload_events_from_vllms_own_classes() -> None:
    out = subprocess.run(
        [str(engines_python()), "-m", "tests.engines.vllm_offload_events"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    payloads = [bytes.fromhex(line) for line in out.stdout.split()]
    assert payloads == [bytes.fromhex(line) for line in FIXTURE.read_text().split()]
    live = Listener()
    for at, payload in enumerate(payloads):
        live.apply(payload)
        if at == STORAGE_REMOVAL:
            assert live.sink.state == dict.fromkeys(keys(), "storage_warm"), "the CPU copy still holds the block"
        if at == CPU_REMOVAL:
            assert live.sink.state == {}
