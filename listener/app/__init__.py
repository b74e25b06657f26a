"""The listener process, split like the picker's runtime: ``lifecycle`` composes it and runs start → serve →
drain → stop (the HTTP and gRPC servers, readiness, /healthz), ``sources`` holds the live sources with their
trackers, feeds and tasks, ``discovery`` makes the live sources those of the pool. See docs/listener.md#the-app.
"""

from __future__ import annotations

from listener.app.lifecycle import ListenerApp, StartupError

__all__ = ["ListenerApp", "StartupError"]
