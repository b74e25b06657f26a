"""llm-d's stateless session affinity: the ``x-session-token`` header. The picker mints the token of the endpoint
that answered (the base64 of ``namespace/name``, as llm-d does) and echoes it on the response; a later request
that carries it goes back to that endpoint while it is eligible. Nothing is stored: any picker of the pool reads
any picker's token, and one minted by llm-d's endpoint picker for the same pod. See docs/llm-d-compat.md.
"""

from __future__ import annotations

import base64
import binascii

MAX_TOKEN_CHARS = 512  # a longer header is not a token of ours: ignored (never decoded)


class SessionTokens:
    """Mints and reads tokens for one pool. ``namespace``: the pool's Kubernetes namespace (its pods'), None for a
    static pool, whose tokens carry the endpoint's name alone."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace

    def mint(self, name: str) -> str:
        """The token of endpoint ``name``."""
        text = f"{self.namespace}/{name}" if self.namespace else name
        return base64.b64encode(text.encode()).decode("ascii")

    def endpoint(self, token: str | None) -> str | None:
        """The endpoint name a token names, or None: absent, too long, not base64 of UTF-8 text, or a pod of
        another namespace. Padding may be missing and the URL-safe alphabet is accepted (a client may have
        re-encoded it). Whether the endpoint exists and is eligible is the routing core's question."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        raw = token.strip().replace("-", "+").replace("_", "/")
        raw += "=" * (-len(raw) % 4)
        try:
            text = base64.b64decode(raw, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        ns, sep, name = text.rpartition("/")
        if not sep:
            return text or None
        if self.namespace is not None and ns != self.namespace:
            return None
        return name or None
