"""Hostile engine payloads against the listener's decoder and block-chain tracker: peak RSS and time to
decode + apply each one, and the longest synchronous stretch when the batch is applied in work units.

    python -m benchmarks.listener_hostile [--case NAME ...] [--code-root DIR]

Each case runs in a fresh subprocess (peak RSS = ru_maxrss of that process minus its RSS after imports).
``--code-root`` runs the cases against another checkout of the project (e.g. a worktree of an older
commit) for a before/after comparison; the cases import ``listener.api``, so copy that file into an
older checkout first (it names the same objects).

Cases:
- ``bomb_29mib``: a 29.6 MiB batch of tiny empty arrays (about 31 million containers, every array within
  msgpack's length limits); libzmq already refuses it past ``max_message_bytes``, this measures the
  decoder as if the limit were raised.
- ``bomb_8mib``: the same at 7.9 MiB, inside the default ``max_message_bytes``.
- ``stored_1m``: one BlockStored with 1,000,000 page-size-1 pages (1M hashes, 1M tokens).
- ``removed_1m``: one BlockRemoved with 1,000,000 hashes.
- ``stored_at_cap``: one BlockStored with ``max_event_hashes`` page-size-1 pages (accepted).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES = ("bomb_29mib", "bomb_8mib", "stored_1m", "removed_1m", "stored_at_cap")


def _bomb(total_bytes: int) -> bytes:
    per = 65_536
    inner = b"\xdd" + per.to_bytes(4, "big") + b"\x90" * per
    n = max(1, total_bytes // len(inner))
    return b"\x93\xcb" + b"\0" * 8 + b"\xdd" + n.to_bytes(4, "big") + inner * n + b"\x00"


def _payload(case: str, cap: int) -> bytes:
    import msgpack

    if case == "bomb_29mib":
        return _bomb(int(29.6 * (1 << 20)))
    if case == "bomb_8mib":
        return _bomb(int(7.9 * (1 << 20)))
    if case in ("stored_1m", "stored_at_cap"):
        n = 1_000_000 if case == "stored_1m" else cap
        ev = {"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "parent_block_hash": None,
              "token_ids": [i % 50_000 for i in range(n)], "block_size": 1, "medium": "GPU"}  # fmt: skip
        return msgpack.packb([0.0, [ev], 0])
    if case == "removed_1m":
        ev = {"type": "BlockRemoved", "block_hashes": list(range(1, 1_000_001)), "medium": "GPU"}
        return msgpack.packb([0.0, [ev], 0])
    raise SystemExit(f"unknown case {case}")


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def run_case(case: str) -> dict[str, Any]:
    """One case in this process: decode, then apply (in work units when the code has them)."""
    from listener.api import BlockChainTracker, DecodeError, LimitsConfig, SourceConfig, decode_batch, work_units

    class Sink:
        def emit(self, op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
            pass

        def clear(self, reason: str) -> None:
            pass

    limits = LimitsConfig()
    cap = limits.max_event_hashes
    payload = _payload(case, cap)
    src = SourceConfig(backend_name="b", engine="sglang", model="m", zmq_endpoint="tcp://x:1")
    tracker = BlockChainTracker(src, limits, Sink())
    base = _rss_kib()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"case": case, "payload_bytes": len(payload)}
    try:
        batch = decode_batch(payload, "sglang", limits.max_event_tokens)
    except DecodeError as exc:
        result["outcome"] = f"batch dropped ({exc.reason})"
        batch = None
    t1 = time.perf_counter()
    longest = 0.0
    if batch is not None:
        reasons = {r: batch.dropped.count(r) for r in sorted(set(batch.dropped))}
        result["outcome"] = f"{len(batch.events)} events applied, dropped events {reasons or 'none'}"
        units = work_units(batch.events, limits.apply_slice_blocks)
        for unit in units:
            s = time.perf_counter()
            for ev in unit:
                tracker.apply(ev)
            longest = max(longest, time.perf_counter() - s)
    t2 = time.perf_counter()
    result.update(
        decode_s=round(t1 - t0, 3),
        apply_s=round(t2 - t1, 3),
        longest_slice_s=round(longest, 4),
        peak_rss_growth_mib=round((_rss_kib() - base) / 1024, 1),
        tracked_blocks=tracker.tracked_blocks,
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=CASES)
    ap.add_argument("--code-root", type=Path, default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one)))
        return
    root = (args.code_root or Path(__file__).resolve().parent.parent).resolve()
    env = dict(os.environ, PYTHONPATH=str(root))
    here = Path(__file__).resolve()
    print(f"code: {root}")
    print(
        f"{'case':<14} {'payload':>10} {'decode s':>9} {'apply s':>8} {'longest slice s':>16} {'RSS +MiB':>9}  outcome"
    )
    for case in args.case or CASES:
        out = subprocess.run(
            [sys.executable, str(here), "--one", case], cwd=root, env=env, capture_output=True, text=True
        )
        if out.returncode != 0:
            print(f"{case:<14} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{case:<14} {r['payload_bytes']:>10} {r['decode_s']:>9} {r['apply_s']:>8} {r['longest_slice_s']:>16} "
            f"{r['peak_rss_growth_mib']:>9}  {r['outcome']}"
        )


if __name__ == "__main__":
    main()
