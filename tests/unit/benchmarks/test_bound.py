"""The hit-rate bound on a tiny hand-computed trace."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bound import bound_hit_rate, main
from benchmarks.engine_sim.tokenizer import chat_token_ids
from benchmarks.trace import TraceRecord, write_trace


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def completion(t: float, prompt: str) -> TraceRecord:
    return TraceRecord(t, "/v1/completions", {"prompt": prompt})


def test_bound_on_a_hand_computed_trace() -> None:
    a8, b8 = words("a", 8), words("b", 8)
    records = [
        completion(0.0, a8 + " " + words("x", 6)),  # 14 tokens, blocks A0 A1 X0(partial 2)... 3 full: 0 hits
        completion(2.0, a8 + " " + words("z", 4)),  # 12 tokens, 3 full blocks: A0 A1 hit, Z0 new: 8
        completion(1.0, a8),  # arrives second: 8 tokens, A0 A1 both seen: 8 hits (every full block counts)
        completion(3.0, b8 + " " + a8),  # B0 new, so nothing after it counts: 0
    ]
    result = bound_hit_rate(records, block_size=4)
    assert result.prompt_tokens == 14 + 12 + 8 + 16
    assert result.hit_tokens == 0 + 8 + 8 + 0
    assert result.hit_rate == 16 / 50
    assert result.requests == 4
    # vLLM's last-token rule: the 8-token repeat can hit only (8 - 1) // 4 = 1 block
    assert bound_hit_rate(records, block_size=4, vllm_last_token_rule=True).hit_tokens == 0 + 4 + 8 + 0


def test_bound_uses_the_chat_template(tmp_path: Path, capsys: object) -> None:
    messages = [{"role": "system", "content": words("s", 30)}, {"role": "user", "content": "hi"}]
    n = len(chat_token_ids(messages))  # 1 + 30 + 1 + 1 + 1 + 1 + 1 = 36 tokens
    assert n == 36
    records = [TraceRecord(float(i), "/v1/chat/completions", {"messages": messages}) for i in range(2)]
    result = bound_hit_rate(records, block_size=16)
    assert result.hit_tokens == 32 and result.prompt_tokens == 72
    path = tmp_path / "t.jsonl"
    write_trace(path, records)
    assert main([str(path), "--block-size", "16"]) == 0
