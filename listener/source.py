"""The event source Protocol: what the listener's app needs of an engine's event source, whatever carries the
events (vLLM and SGLang over ZMQ, ``listener.zmq_source``; TensorRT-LLM over HTTP, ``listener.trtllm_source``;
a gRPC source later). The app holds every source as an ``EventSource`` and asks it, never its type, what it
can do. See docs/listener.md#sources.
"""

from __future__ import annotations

from typing import Protocol

from listener.config import SourceConfig
from listener.state_store import PersistedSource


class SourceOpenError(Exception):
    """A source's endpoint could not be opened (a bind address in use, too many open files, ...)."""


class EventSource(Protocol):
    """One engine's event stream applied to its block-chain tracker.

    Lifecycle: ``open()`` (synchronous, before ``run``: a bind error is the caller's to report), ``run()`` until
    cancelled (nothing an engine sends ends it), ``close()`` (idempotent; also after a failed ``open``)."""

    @property
    def name(self) -> str:
        """The backend name (the picker's endpoint name)."""
        ...

    @property
    def cfg(self) -> SourceConfig: ...

    @property
    def endpoint(self) -> str:
        """Where the events come from (logs and errors)."""
        ...

    @property
    def connected(self) -> bool:
        """The engine is reachable now (a ZMQ peer handshaken, the last HTTP poll answered)."""
        ...

    @property
    def backlog_bytes(self) -> int | None:
        """Engine bytes received and not yet applied; None for a source without a receive queue."""
        ...

    def open(self) -> None:
        """Open the endpoint; raises ``SourceOpenError``. A source with nothing to open does nothing."""
        ...

    def close(self) -> None: ...

    async def run(self) -> None: ...

    def status(self, stale_after: float) -> dict[str, object]:
        """The source's /healthz entry: ``state``, ``connected``, ``state_age_seconds`` (a float), ... (see
        ``listener.events.source_status``) and what the source adds."""
        ...

    def persistence(self) -> PersistedSource | None:
        """The source's restart-proof state hooks (``listener.state_store``), or None when it keeps none."""
        ...
