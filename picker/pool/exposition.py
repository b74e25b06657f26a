"""The Prometheus text format, parsed strictly and within bounds (``parse_exposition``): possessive patterns (a
hostile line costs one pass), only the wanted families examined, a line that does not parse skipped and counted.
See docs/picker.md, "Engine signals" (the parser).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

MAX_LINE_CHARS = 64 * 1024  # a longer line is skipped unparsed
MAX_LABELS = 64  # per sample; more: the line is skipped
MAX_WANTED_SERIES = 4096  # wanted-family samples kept per body; more are counted as dropped
METRIC_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
_LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*+"'  # the three escapes the format defines, nothing else
_LABEL = rf"{_LABEL_NAME}[ \t]*+=[ \t]*+{_LABEL_VALUE}"
_LABELS = rf"\{{[ \t]*+(?:{_LABEL}(?:[ \t]*+,[ \t]*+{_LABEL})*+[ \t]*+,?[ \t]*+)?\}}"
# Go's ParseFloat forms Prometheus writes: decimal, exponent, NaN, +Inf / -Inf (no hex, no underscores).
# Every quantifier is possessive: a hostile line costs one pass, never a backtracking search.
_VALUE = r"[+-]?(?:(?:[0-9]++(?:\.[0-9]*+)?|\.[0-9]++)(?:[eE][+-]?[0-9]++)?|Inf|inf|NaN|nan)"
_SAMPLE_RE = re.compile(
    rf"[ \t]*+({_NAME})(?:[ \t]*+({_LABELS}))?[ \t]++({_VALUE})(?:[ \t]++(-?[0-9]{{1,19}}))?[ \t]*+"
)
_LABEL_RE = re.compile(rf'({_LABEL_NAME})[ \t]*+=[ \t]*+"((?:[^"\\\n]|\\[\\"n])*+)"')
_COMMENT_RE = re.compile(rf"[ \t]*+#[ \t]++(HELP|TYPE)[ \t]++({_NAME})(?:[ \t]++(.*))?", re.S)
_HELP_OR_TYPE_RE = re.compile(r"[ \t]*+#[ \t]++(?:HELP|TYPE)(?:[ \t]|$)")
_UNESCAPE_RE = re.compile(r"\\([\\\"n])")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(slots=True, frozen=True)
class Sample:
    """One sample line: metric name, labels (sorted by name), value, optional timestamp (ms)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int | None = None

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


@dataclass(slots=True)
class Exposition:
    """What ``parse_exposition`` read: samples (of the wanted families, or all), declared types, and counts
    of the lines examined, skipped (did not parse) and dropped (beyond the sample bound)."""

    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)  # one per family declared (of the wanted ones)
    examined: int = 0
    skipped: int = 0
    dropped: int = 0

    def family(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]


def _unescape(value: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPED[m.group(1)], value) if "\\" in value else value


def parse_sample(line: str) -> Sample | None:
    """One sample line, strictly (None: not a valid sample line). Never raises."""
    if len(line) > MAX_LINE_CHARS:
        return None
    m = _SAMPLE_RE.fullmatch(line)
    if m is None:
        return None
    name, raw_labels, raw_value, raw_ts = m.groups()
    labels: tuple[tuple[str, str], ...] = ()
    if raw_labels:
        pairs = [(k, _unescape(v)) for k, v in _LABEL_RE.findall(raw_labels)]
        if len(pairs) > MAX_LABELS or len({k for k, _ in pairs}) != len(pairs):
            return None  # too many labels, or one label twice
        labels = tuple(sorted(pairs))
    value = float(raw_value)  # the regex admits only what float() reads
    return Sample(name, labels, value, int(raw_ts) if raw_ts is not None else None)


_LINE_PREFIX_RE = re.compile(r"[ \t]*+(?:#[ \t]++(?:HELP|TYPE)[ \t]++)?")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:")


def _wanted_lines(text: str, families: Iterable[str]) -> Iterator[str]:
    """The lines that start with a wanted family's name (a sample, or its HELP / TYPE comment), found with
    ``str.find`` (no per-line work for the other lines). Each line is visited at most once per family: after
    a hit the search resumes at the next line, so a line repeating a name many times costs one pass."""
    n = len(text)
    for family in families:
        pos = 0
        while (i := text.find(family, pos)) >= 0:
            start = text.rfind("\n", 0, i) + 1
            end = text.find("\n", i)
            end = n if end < 0 else end
            pos = end + 1
            if i - start > MAX_LINE_CHARS:
                continue  # the line's first occurrence is too far in for the line to be kept
            # The line's name starts where its prefix (indent, "# HELP " / "# TYPE ") ends: the first occurrence
            # may lie inside the prefix itself (P, E, YP in HELP / TYPE), so the name is checked there.
            prefix = _LINE_PREFIX_RE.match(text, start, min(end, start + MAX_LINE_CHARS))  # all optional: matches
            name_at = prefix.end() if prefix is not None else start
            if not text.startswith(family, name_at):
                continue  # the name inside another line (a label value, another family's HELP text)
            after = name_at + len(family)
            if after < n and text[after] in _NAME_CHARS:
                continue  # a longer name that starts with this one
            yield text[start:end]


def largest_sample(text: str, family: str) -> Sample | None:
    """The sample of ``family`` with the largest finite value, read in one pass that keeps only the best so far
    (a family whose series accumulate, as vLLM's ``lora_requests_info``: one series per label set ever seen,
    its value the time it was last set). Only that family's lines are examined; bad lines are passed over.
    Never raises; None when no valid sample."""
    best: Sample | None = None
    for raw in _wanted_lines(text, (family,)):
        line = raw[:-1] if raw.endswith("\r") else raw
        if line.lstrip(" \t").startswith("#"):
            continue
        s = parse_sample(line)
        if s is not None and s.name == family and math.isfinite(s.value) and (best is None or s.value > best.value):
            best = s
    return best


def _all_lines(text: str) -> Iterator[str]:
    start = 0
    n = len(text)
    while start < n:
        end = text.find("\n", start)
        if end < 0:
            end = n
        yield text[start:end]
        start = end + 1


def parse_exposition(
    text: str,
    families: frozenset[str] | None = None,
    max_samples: int = MAX_WANTED_SERIES,
) -> Exposition:
    """Parse Prometheus text format. ``families``: read only these metric families (the lines of the others
    are never examined); None: every line. Bounded: at most ``max_samples`` samples kept; once that many are
    kept, the remaining sample lines are counted in ``dropped`` without being parsed; lines longer than
    ``MAX_LINE_CHARS`` are skipped. Never raises on any text."""
    out = Exposition()
    if families is None:
        lines: Iterable[str] = _all_lines(text)
    else:
        lines = _wanted_lines(text, sorted(families))
    for raw in lines:
        line = raw[:-1] if raw.endswith("\r") else raw
        if not line or line.isspace():
            continue
        out.examined += 1
        if len(line) > MAX_LINE_CHARS:
            out.skipped += 1
            continue
        if line.lstrip(" \t").startswith("#"):
            c = _COMMENT_RE.fullmatch(line)
            if c is None:
                out.skipped += _HELP_OR_TYPE_RE.match(line) is not None  # any other comment is allowed
                continue
            kind, name, rest = c.groups()
            if kind == "TYPE":
                declared = (rest or "").strip(" \t")
                if declared not in METRIC_TYPES:
                    out.skipped += 1
                elif (families is None or name in families) and len(out.types) < max_samples:
                    out.types[name] = declared
            continue
        if len(out.samples) >= max_samples:
            out.dropped += 1
            continue
        sample = parse_sample(line)
        if sample is None:
            out.skipped += 1
        elif families is None or sample.name in families:
            out.samples.append(sample)
    return out
