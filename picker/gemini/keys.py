"""The API key of a ``type: gemini`` backend, read from its ``api_key_file`` (a mounted Secret): one reader for the
request path's keys (``picker.gemini.route.ApiKeys``) and the context cache's API client. The key is never put in
a message. See docs/gemini.md.
"""

from __future__ import annotations

KEY_FILE_MAX_BYTES = 4096  # an API key is ~40 characters: a larger file is refused, never read whole


def read_key_file(path: str) -> str:
    """The key in ``path`` (surrounding whitespace removed): printable ASCII without spaces. ValueError saying
    what is wrong with the file, never the key."""
    try:
        with open(path, "rb") as f:
            raw = f.read(KEY_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > KEY_FILE_MAX_BYTES:
        raise ValueError(f"larger than {KEY_FILE_MAX_BYTES} bytes, not an API key")
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError("not ASCII text") from None
    if not key:
        raise ValueError("empty (the API key is the file's content)")
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("the key holds a space, a control or a non-ASCII character (one line expected)")
    return key
