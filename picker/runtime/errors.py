"""``StartupError``: why the picker cannot start, as one line for the user (``kv-epp serve`` exits 2). Raised by
the lifecycle (a port in use, TLS or exposure refused) and the admin app (an unreadable token file)."""

from __future__ import annotations


class StartupError(Exception):
    """The picker cannot start (a port in use, ...): one line for the user, exit code 2."""
