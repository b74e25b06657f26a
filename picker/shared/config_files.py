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
from pydantic import AfterValidator, ValidationError

BACKEND_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_backend_name(v: str) -> str:
    if not BACKEND_NAME_RE.match(v):
        raise ValueError("must match [A-Za-z0-9_-]{1,64}")
    return v


# A backend (replica) name: metric label, KV-index id and feed path segment, hence the strict charset.
BackendName = Annotated[str, AfterValidator(_check_backend_name)]


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` are (dotted path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


def _loc(loc: Iterable[int | str]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "<root>"


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """(dotted path, message) for every error pydantic found."""
    return [(_loc(e["loc"]), e["msg"]) for e in exc.errors()]


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file ({} when empty); ConfigError when unreadable or not a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("<file>", f"cannot read {path}: {exc.strerror}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([("<file>", f"invalid YAML in {path}: {exc}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("<root>", "the config file must hold a mapping of sections")])
    return data
