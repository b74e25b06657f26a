"""The names Envoy and the picker agree on for external backends (``type: gemini``). See docs/gemini.md."""

from __future__ import annotations

# The picker's choice of an external upstream: a route matches it after the picker's answer clears the route
# cache. A client's own value is removed before any filter.
UPSTREAM_HEADER = "x-kv-epp-upstream"


def external_cluster_name(backend_name: str) -> str:
    """The Envoy cluster (and the ``UPSTREAM_HEADER`` value) of an external backend."""
    return f"external_{backend_name}"
