"""Tier 1 prefix key, exactly as the seed defines it: SHA-256 over the model and the first bytes of the system
prompt, the first message or the token ids.
See docs/picker.md, "The prefix key and the CHWBL ring".
"""

from __future__ import annotations

import struct
from hashlib import sha256

from picker.facts import RequestFacts


def truncate_utf8(text: str, max_bytes: int) -> bytes:
    """UTF-8 bytes of ``text`` cut to at most ``max_bytes`` without splitting a character."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return raw
    end = max_bytes
    while end > 0 and (raw[end] & 0xC0) == 0x80:  # raw[end] is a continuation byte: back off
        end -= 1
    return raw[:end]


def prefix_key(facts: RequestFacts, *, enabled: bool, max_prefix_length: int) -> bytes | None:
    """The 32-byte prefix key of a request, or None."""
    if not enabled or not facts.model:
        return None
    if facts.system:
        tag, text = b"S", facts.system
    elif facts.first_message:
        tag, text = b"M", facts.first_message
    elif facts.prompt_token_ids:
        ids = facts.prompt_token_ids[: max(1, max_prefix_length // 4)]
        h = sha256(facts.model.encode("utf-8"))
        h.update(b"\x00T")
        h.update(struct.pack(f"<{len(ids)}I", *ids))  # ids are < 2**32 (checked by the parser)
        return h.digest()
    else:
        return None
    h = sha256(facts.model.encode("utf-8"))
    h.update(b"\x00" + tag)
    h.update(truncate_utf8(text, max_prefix_length))
    return h.digest()
