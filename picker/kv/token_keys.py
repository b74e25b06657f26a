"""The tokenization cache's keys: where a prompt may be cut (message boundaries, a completions prompt's chunks at
whitespace), the chained BLAKE2b digest that names each point, and the safety margin a prefix entry keeps.
See docs/picker.md, "The tokenization cache".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Literal

import orjson

PROMPT_CHUNK_CHARS = 2048  # a completions prompt is cut at the last whitespace before each multiple of this

_TAG_ROOT = b"kv-epp/token-cache/v1\x00"
_TAG_SEGMENT = b"\x01"
_TAG_EXACT = b"\x02exact"
_WS = (" ", "\n", "\t", "\r")

Kind = Literal["chat", "prompt"]


def _h(data: bytes) -> bytes:
    return blake2b(data, digest_size=32).digest()


def _framed(data: bytes) -> bytes:
    return _TAG_SEGMENT + len(data).to_bytes(8, "big") + data


def root_digest(kind: Kind, model: str) -> bytes:
    """``d0``: a chain's start, one per (kind, model)."""
    raw = model.encode("utf-8", "surrogatepass")
    return _h(_TAG_ROOT + kind.encode() + b"\x00" + len(raw).to_bytes(8, "big") + raw)


def chain_digest(parent: bytes, segment: bytes) -> bytes:
    """``d_j`` from ``d_{j-1}`` and segment *j*'s bytes."""
    return _h(parent + _framed(segment))


def exact_digest(last: bytes) -> bytes:
    """The key of a whole prompt whose segments chain to ``last``."""
    return _h(last + _TAG_EXACT)


def canonical_message(message: Any) -> bytes:
    """A chat message as the digest sees it: its JSON with keys sorted (every field a template may read)."""
    return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)


def prompt_cuts(prompt: str, chunk: int = PROMPT_CHUNK_CHARS) -> list[int]:
    """The content-defined cut positions of a completions prompt (docs/picker.md, "The tokenization cache"), ascending,
    each > 0 and < len(prompt). Cut *j* is the last whitespace before ``j × chunk``; a window without
    whitespace has no cut."""
    cuts: list[int] = []
    last = 0
    for edge in range(chunk, len(prompt), chunk):
        at = max(prompt.rfind(w, last + 1, edge) for w in _WS)
        if at > last:
            cuts.append(at)
            last = at
    return cuts


@dataclass(slots=True)
class Segments:
    """A request's points: ``keys[j-1]`` is point *j*'s digest, ``sizes[j-1]`` the bytes of its segments,
    ``cuts[j-1]`` what a fill tokenizes (chat: that many messages; prompt: that many characters)."""

    kind: Kind
    model: str
    keys: list[bytes]
    sizes: list[int]
    cuts: list[int]
    exact_key: bytes
    total: int
    messages: Sequence[Any] | None = None
    prompt: str | None = None


def chat_segments(model: str, messages: Sequence[Any]) -> Segments:
    """Points of a chat request: one per message."""
    d = root_digest("chat", model)
    keys: list[bytes] = []
    sizes: list[int] = []
    size = 0
    for m in messages:
        c = canonical_message(m)
        d = chain_digest(d, c)
        size += len(c)
        keys.append(d)
        sizes.append(size)
    return Segments("chat", model, keys, sizes, list(range(1, len(keys) + 1)), exact_digest(d), size, messages=messages)


def prompt_segments(model: str, prompt: str, chunk: int = PROMPT_CHUNK_CHARS) -> Segments:
    """Points of a completions prompt: one per content-defined cut (the tail after the last cut is not a
    point; the exact key covers it)."""
    d = root_digest("prompt", model)
    keys: list[bytes] = []
    sizes: list[int] = []
    cuts = prompt_cuts(prompt, chunk)
    prev = 0
    size = 0
    for cut in cuts:
        raw = prompt[prev:cut].encode("utf-8", "surrogatepass")
        d = chain_digest(d, raw)
        size += len(raw)
        keys.append(d)
        sizes.append(size)
        prev = cut
    tail = prompt[prev:].encode("utf-8", "surrogatepass")
    d = chain_digest(d, tail)
    return Segments("prompt", model, keys, sizes, cuts, exact_digest(d), size + len(tail), prompt=prompt)


def safe_length(n_ids: int, block_size: int) -> int:
    """Ids a prefix entry keeps of a rendering of ``n_ids`` ids: drop the partial last block and one more."""
    return max(0, n_ids // block_size - 1) * block_size
