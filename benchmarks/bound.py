"""The hit-rate bound of a trace (docs/benchmarks.md): one replica with unlimited cache that saw the whole
run in arrival order. Each full block of a request's prompt counts as a hit if an earlier request
contained the same chained block; the rate is hit tokens / prompt tokens (tokens, not requests).
No router can beat it.

Token ids come from the simulator's tokenizer and chat template, block hashes from its engine hash,
so the bound is exactly comparable with the simulators' ``prefix_cache_*`` counters.

``vllm_last_token_rule=True`` also applies vLLM's rule that the last prompt token is always computed
(a fully cached prompt hits at most ``(len - 1) // block_size`` blocks), as the simulator does; the
docs/benchmarks.md definition (the default) counts every full block.

Memory: one 32-byte digest per distinct full block of the trace (the set is the trace's working set).

CLI: ``python -m benchmarks.bound TRACE.jsonl [--block-size 16]`` prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from benchmarks.engine_sim.prefix_cache import engine_block_hashes
from benchmarks.engine_sim.tokenizer import request_token_ids
from benchmarks.trace import TraceRecord, read_trace


@dataclass(slots=True, frozen=True)
class BoundResult:
    """The bound and the token counts behind it."""

    hit_tokens: int
    prompt_tokens: int
    requests: int
    distinct_blocks: int
    block_size: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def bound_hit_rate(
    records: Iterable[TraceRecord],
    block_size: int = 16,
    hash_seed: str = "",
    vllm_last_token_rule: bool = False,
) -> BoundResult:
    """The bound over ``records`` in arrival order (sorted by ``t``, stable)."""
    seen: set[bytes] = set()  # bound: the trace's distinct full blocks (see module docstring)
    hit_tokens = prompt_tokens = requests = 0
    for record in sorted(records, key=lambda r: r.t):
        ids = request_token_ids(record.path, record.body)
        digests = engine_block_hashes(ids, block_size, hash_seed)
        limit = max(0, (len(ids) - 1) // block_size) if vllm_last_token_rule else len(digests)
        hits = 0
        while hits < limit and digests[hits] in seen:
            hits += 1
        seen.update(digests)
        hit_tokens += hits * block_size
        prompt_tokens += len(ids)
        requests += 1
    return BoundResult(hit_tokens, prompt_tokens, requests, len(seen), block_size)


def main(argv: list[str] | None = None) -> int:
    """Print the bound of a trace file as JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bound", description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="JSONL trace file")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-seed", default="")
    parser.add_argument("--vllm-last-token-rule", action="store_true")
    args = parser.parse_args(argv)
    result = bound_hit_rate(read_trace(args.trace), args.block_size, args.hash_seed, args.vllm_last_token_rule)
    print(json.dumps({**asdict(result), "hit_rate": result.hit_rate}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
