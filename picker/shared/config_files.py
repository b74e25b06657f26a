"""Config files the picker and the listener both read: YAML loading, error paths, backend names.

Every problem a user can cause is a ``ConfigError`` holding (dotted path, message) pairs, so each CLI
prints "error: <path>: <message>" and exits 2.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, ValidationError, WithJsonSchema

# A Kubernetes pod name (a DNS-1123 subdomain: up to 253 characters, dots included) plus a data-parallel rank
# suffix fits; the first character is never a dot, so "." and ".." (path segments) cannot be names.
BACKEND_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,259}$")
MAX_YAML_ALIASES = 100  # a config file reuses a block a few times (`<<: *defaults`), never thousands
MAX_YAML_DEPTH = 64  # a config is ~5 levels deep; the bound keeps PyYAML's recursive composer far from RecursionError


def _check_backend_name(v: str) -> str:
    if not BACKEND_NAME_RE.fullmatch(v):  # match() would let a trailing newline through ($)
        raise ValueError(
            "must be 1-260 characters of letters, digits, '_', '-' and '.', not starting with '.' or '-' "
            "(a Kubernetes pod name fits)"
        )
    return v


# A backend (replica) name: metric label, KV-index id and feed path segment, hence the strict charset.
BackendName = Annotated[
    str,
    AfterValidator(_check_backend_name),
    WithJsonSchema({"type": "string", "pattern": BACKEND_NAME_RE.pattern}),
]


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` are (dotted path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


UNION_TAG_PREFIX = "type="  # a discriminated union's tag (``Tag("type=gemini")``): in pydantic's loc, not in the file


def _loc(loc: Iterable[int | str]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, str) and item.startswith(UNION_TAG_PREFIX):
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "<root>"


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """(dotted path, message) for every error pydantic found."""
    return [(_loc(e["loc"]), e["msg"]) for e in exc.errors()]


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses what a config file never needs: duplicate keys (YAML says they are an
    error, PyYAML keeps the last), keys that are not strings, nesting deeper than MAX_YAML_DEPTH, and
    more than MAX_YAML_ALIASES aliases (each alias may stand for a whole subtree: a "billion laughs"
    document is small on disk and exponential for whatever walks the loaded data)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > MAX_YAML_ALIASES:
                    mark = self.peek_event().start_mark
                    raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_ALIASES} aliases", mark)
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges are allowed to be overridden by explicit keys
            key = self.construct_object(key_node, deep=True)
            mark = key_node.start_mark
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is not a string (quote it)", mark)
            if key in first_line:
                problem = f"duplicate key {key!r} (first on line {first_line[key]})"
                raise yaml.constructor.ConstructorError(None, None, problem, mark)
            first_line[key] = mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file ({} when empty); ConfigError when unreadable, not UTF-8,
    not YAML, not a mapping, nested too deep, with duplicate or non-string keys."""
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([(where, f"cannot read the file: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError([(where, f"not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}")]) from None
    try:
        loader = _ConfigLoader(text)  # the reader refuses control characters here already
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError([(where, f"invalid YAML: {_one_line(exc)}")]) from None
    except RecursionError:  # the depth bound should make this unreachable; never a traceback
        raise ConfigError([(where, f"invalid YAML: nested deeper than {MAX_YAML_DEPTH} levels")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("<root>", "the config file must hold a mapping of sections")])
    return data


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's message without its multi-line source excerpt: problem and where."""
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [exc.context or "", exc.problem or ""]
        mark = exc.problem_mark or exc.context_mark
        text = ", ".join(p for p in parts if p)
        return f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
    return " ".join(str(exc).split())


def one_line(text: object) -> str:
    """``text`` on one line (a user error is one stderr line, whatever the message holds)."""
    return " ".join(str(text).split())


def other_program_hint(path: str, prog: str, mine: Iterable[str], theirs: Iterable[str], other: str) -> str | None:
    """When the YAML file ``path`` is a mapping with none of ``prog``'s top-level keys and some of ``other``'s:
    the message that points at ``other``'s check (instead of one "Extra inputs are not permitted" per key)."""
    try:
        data = read_yaml_mapping(path)
    except ConfigError:
        return None
    keys = set(data)
    ours, found = keys & set(mine), sorted(keys & set(theirs))
    if not keys or ours or not found:
        return None
    check = f"`{other} config validate {path}`"
    return f"this is a {other} config ({', '.join(found)}), not a {prog} one: check it with {check}"
