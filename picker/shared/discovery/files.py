"""File discovery: the pool's backends listed in a YAML file, re-read when it changes (a file that cannot be used
keeps the last snapshot).
See docs/picker.md, "Pool discovery".
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from picker.shared.config_files import BackendName, ConfigError, read_yaml_mapping, validation_problems
from picker.shared.discovery.config import BackendsFileRef, IpPort
from picker.shared.discovery.model import Count, DiscoveredBackend, PoolSnapshot, Publish

log = logging.getLogger("kv_epp.discovery")

MAX_FILE_BYTES = 16 << 20  # a larger file is refused (the last snapshot is kept)
MAX_BACKENDS = 100_000  # entries in one file
MAX_ANNOTATIONS = 256  # per backend


class _FileBackend(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: BackendName
    address: IpPort
    annotations: dict[str, str] = Field(default_factory=dict, max_length=MAX_ANNOTATIONS)
    ready: bool = True
    role: Literal["prefill", "decode", "both"] = "both"  # P/D (docs/pd.md)


class _BackendsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backends: list[_FileBackend] = Field(max_length=MAX_BACKENDS)


def load_backends_file(path: str | Path) -> tuple[DiscoveredBackend, ...]:
    """The backends a file lists, sorted by name; ConfigError with (dotted path, message) pairs when it cannot
    be used. Blocking: call it off the event loop."""
    where = str(path)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise ConfigError([(where, f"cannot read the file: {exc.strerror}")]) from None
    if size > MAX_FILE_BYTES:
        raise ConfigError([(where, f"the file is {size} bytes, over the {MAX_FILE_BYTES} bytes allowed")])
    data = read_yaml_mapping(path)
    try:
        parsed = _BackendsFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc)) from None
    first: dict[str, int] = {}
    first_address: dict[str, int] = {}
    problems: list[tuple[str, str]] = []
    for i, b in enumerate(parsed.backends):
        if b.name in first:
            problems.append((f"backends[{i}].name", f"duplicate of backends[{first[b.name]}].name"))
        if b.address in first_address:
            problems.append((f"backends[{i}].address", f"duplicate of backends[{first_address[b.address]}].address"))
        first.setdefault(b.name, i)
        first_address.setdefault(b.address, i)
    if problems:
        raise ConfigError(problems)
    out = []
    for b in parsed.backends:
        host, _, port = b.address.rpartition(":")
        ip = ipaddress.ip_address(host.strip("[]"))
        out.append(
            DiscoveredBackend(
                name=b.name,
                ip=str(ip),
                port=int(port),
                annotations=tuple(sorted(b.annotations.items())),
                ready=b.ready,
                role=b.role,
            )
        )
    out.sort(key=lambda d: d.name)
    return tuple(out)


class FileDiscovery:
    """Backends from a YAML file (docs/picker.md, "Pool discovery"); implements ``Discovery``. Counters: "load" (a
    changed file read and used), "error" (one that could not be)."""

    def __init__(self, ref: BackendsFileRef, count: Count | None = None) -> None:
        self._ref = ref
        self._count_cb = count
        self._synced = False
        self._published: tuple[DiscoveredBackend, ...] | None = None
        self._version = ""
        self._last_error: str | None = None
        self._counts: dict[str, int] = {}  # keys: the two counter names above

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def source(self) -> str:
        return f"file {self._ref.path}"

    def status(self) -> dict[str, object]:
        return {
            "source": self.source,
            "synced": self._synced,
            "backends": len(self._published or ()),
            "resource_version": self._version,
            "last_error": self._last_error,
            "counts": dict(self._counts),
        }

    async def run(self, publish: Publish) -> None:
        seen: tuple[int, int, int] | None = None
        missing_logged = False
        while True:
            try:
                st = os.stat(self._ref.path)
                signature: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError as exc:
                signature = None
                if not missing_logged:  # once per disappearance; the last snapshot stays
                    self._fail(f"{self._ref.path}: cannot read the file: {exc.strerror}")
                    missing_logged = True
            if signature is not None and signature != seen:
                seen = signature
                missing_logged = False
                await self._load(publish, signature)
            await asyncio.sleep(self._ref.poll_seconds)

    async def _load(self, publish: Publish, signature: tuple[int, int, int]) -> None:
        try:
            backends = await asyncio.to_thread(load_backends_file, self._ref.path)
        except ConfigError as exc:
            where = self._ref.path
            self._fail("; ".join(f"{p}: {m}" if p == where else f"{where}: {p}: {m}" for p, m in exc.problems))
            return
        self._count("load")
        self._last_error = None
        self._version = str(signature[0])
        first = not self._synced
        self._synced = True
        if backends == self._published and not first:
            return
        self._published = backends
        log.info("event=discovery_file_loaded source=%r backends=%d", self.source, len(backends))
        try:
            publish(PoolSnapshot(backends, source=self.source, version=self._version))
        except Exception:  # the consumer's bug must not stop discovery
            log.exception("event=discovery_publish_failed source=%r", self.source)

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1
        if self._count_cb is not None:
            try:
                self._count_cb(name)
            except Exception:
                log.exception("event=discovery_count_failed name=%s", name)

    def _fail(self, message: str) -> None:
        self._count("error")
        self._last_error = message
        log.warning("event=discovery_error source=%r error=%r (the last snapshot is kept)", self.source, message)
