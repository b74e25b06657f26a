"""The simulator's deterministic ``POST /v1/embeddings`` (OpenAI's request and response shapes).

The vector of a text is a normalised bag of hashed features: every lower-cased word (``\\w+``) and every
pair of adjacent words is hashed (blake2b-64) to one of ``dim`` coordinates with a sign taken from the
hash, the counts summed, and the sum scaled to length 1. Texts sharing most of their words and word order
therefore have a high cosine similarity (one word changed in a 24-word question: 0.93) and unrelated texts
a low one (typically below 0.25); the same text always gets the same vector, on every machine.
A text with no word characters hashes as one feature (the whole text).

Request: ``{"model": ..., "input": "text" | ["text", ...], "encoding_format": "float" | "base64",
"dimensions": N}``; ``dimensions`` (1..4096) overrides the default ``DEFAULT_DIM``. Response::

    {"object": "list", "model": ..., "data": [{"object": "embedding", "index": i, "embedding": [...]}],
     "usage": {"prompt_tokens": n, "total_tokens": n}}

``base64`` is the little-endian float32 bytes of the vector (what OpenAI's Python client asks for by
default). ``usage`` counts the simulator tokenizer's tokens (one per whitespace-separated word). Bounds: at
most ``MAX_INPUTS`` texts of at most ``MAX_INPUT_CHARS`` characters each and ``MAX_TOTAL_CHARS`` in all (OpenAI
caps a request near 300k tokens), and at most ``MAX_OUTPUT_VALUES`` coordinates in the answer (texts ×
dimensions); anything else is refused with a message naming the field (``EmbeddingsError``, answered 400 by the
server). The server computes a large request off its event loop (``OFFLOAD_CHARS``).
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import Mapping
from hashlib import blake2b
from itertools import pairwise
from typing import Any

from benchmarks.engine_sim.tokenizer import encode

DEFAULT_DIM = 256
MAX_DIM = 4096
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_INPUT_CHARS = 1 << 20
MAX_TOTAL_CHARS = 2 << 20  # all texts of one request together
MAX_OUTPUT_VALUES = 1 << 19  # texts × dimensions: 2,048 texts of the default 256, or 128 of 4,096
OFFLOAD_CHARS = 64 << 10  # a request with more characters is computed in a worker thread by the server
_WORD = re.compile(r"\w+")


class EmbeddingsError(ValueError):
    """A bad embeddings request; the message names the field."""


def _features(text: str) -> list[str]:
    words = _WORD.findall(text.lower())
    if not words:
        return ["t:" + text]
    return ["w:" + w for w in words] + ["b:" + a + " " + b for a, b in pairwise(words)]


def embed_text(text: str, dim: int = DEFAULT_DIM) -> list[float]:
    """The unit-length vector of ``text`` (``dim`` coordinates); deterministic."""
    acc = [0.0] * dim
    for feature in _features(text):
        h = int.from_bytes(blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
        acc[(h >> 1) % dim] += 1.0 if h & 1 else -1.0
    norm = math.sqrt(math.fsum(x * x for x in acc))
    if norm == 0.0:  # all features cancelled out (possible for tiny texts): fall back to one feature
        h = int.from_bytes(blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        acc[h % dim] = 1.0
        return acc
    return [x / norm for x in acc]


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity of two vectors of the same length."""
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(x * x for x in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)


def _inputs(raw: Any) -> list[str]:
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = raw
    else:
        raise EmbeddingsError("'input' must be a non-empty string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise EmbeddingsError(f"'input' has {len(texts)} texts; at most {MAX_INPUTS}")
    for i, t in enumerate(texts):
        if not t:
            raise EmbeddingsError(f"input[{i}] must not be empty")
        if len(t) > MAX_INPUT_CHARS:
            raise EmbeddingsError(f"input[{i}] is longer than {MAX_INPUT_CHARS} characters")
    total = sum(map(len, texts))
    if total > MAX_TOTAL_CHARS:
        raise EmbeddingsError(f"'input' has {total} characters in all; at most {MAX_TOTAL_CHARS}")
    return texts


def input_chars(body: Mapping[str, Any]) -> int:
    """The characters of a request's ``input`` (0 when it is not a string or a list of strings)."""
    raw = body.get("input")
    if isinstance(raw, str):
        return len(raw)
    if isinstance(raw, list):
        return sum(len(t) for t in raw if isinstance(t, str))
    return 0


def embeddings_body(body: Mapping[str, Any], served_model: str) -> dict[str, Any]:
    """The response body of an embeddings request ``body`` (the model already checked by the server)."""
    texts = _inputs(body.get("input"))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise EmbeddingsError("'encoding_format' must be 'float' or 'base64'")
    dim = body.get("dimensions", DEFAULT_DIM)
    if dim is None:
        dim = DEFAULT_DIM
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
        raise EmbeddingsError(f"'dimensions' must be an integer in 1..{MAX_DIM}")
    if len(texts) * dim > MAX_OUTPUT_VALUES:
        raise EmbeddingsError(
            f"'input' × 'dimensions' is {len(texts)} × {dim} coordinates; at most {MAX_OUTPUT_VALUES} in all"
        )
    data: list[dict[str, Any]] = []
    tokens = 0
    for i, text in enumerate(texts):
        vector = embed_text(text, dim)
        tokens += len(encode(text))
        embedding: list[float] | str = vector
        if fmt == "base64":
            embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    model = body.get("model") or served_model
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
