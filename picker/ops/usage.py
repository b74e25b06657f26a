"""The ``usage`` object at the end of an OpenAI-shaped response (the last SSE event, or the end of a JSON body):
its prompt, cached and completion tokens, read from the response's last bytes without parsing the whole body;
and the seed's bucket of a request's cached ratio, which the picker counts and the experiment report tabulates.
Read by the response sampling (``picker.extproc.sampling``) and the experiments' decision log
(``picker.experiments``). See docs/picker.md, "Response sampling".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_BYTES = 4096  # the usage object of an OpenAI response (last SSE event or end of the JSON) fits in it
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})')


@dataclass(slots=True, frozen=True)
class Usage:
    """A response's token counts; None where the server did not report one (unknown, never zero)."""

    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int | None


def usage_in(tail: bytes) -> Usage | None:
    """The last usage object in ``tail`` (a response's last bytes); None when there is none or it has no
    ``prompt_tokens``."""
    last = None
    for last in _USAGE.finditer(tail):  # noqa: B007 - the last match is the one wanted
        pass
    if last is None:
        return None
    rest = tail[last.end() :]
    prompt = _PROMPT.search(rest)
    if prompt is None:
        return None
    cached = _CACHED.search(rest)
    completion = _COMPLETION.search(rest)
    return Usage(
        int(prompt.group(1)),
        int(cached.group(1)) if cached is not None else None,
        int(completion.group(1)) if completion is not None else None,
    )


def keep_tail(tail: bytes, chunk: bytes) -> bytes:
    """``tail`` followed by ``chunk``, cut to the last ``TAIL_BYTES`` (a long chunk is cut before it is copied)."""
    t = tail + (chunk[-TAIL_BYTES:] if len(chunk) > TAIL_BYTES else chunk)
    return t[-TAIL_BYTES:] if len(t) > TAIL_BYTES else t


# the seed's cached-ratio buckets (cached / prompt tokens of one request), and unknown
RATIO_BUCKETS = ("0", "(0,0.5]", "(0.5,0.9]", "(0.9,1]", "unknown")


def ratio_bucket(prompt: int | None, cached: int | None) -> str:
    """The seed's bucket of ``cached / prompt``: ``0`` (cached == 0), ``(0,0.5]``, ``(0.5,0.9]``, ``(0.9,1]``;
    ``unknown`` when either is unknown or the prompt is empty. Integer bounds: exact at 0.5 and 0.9."""
    if prompt is None or cached is None or prompt <= 0:
        return "unknown"
    if cached <= 0:
        return "0"
    return "(0,0.5]" if 2 * cached <= prompt else "(0.5,0.9]" if 10 * cached <= 9 * prompt else "(0.9,1]"
