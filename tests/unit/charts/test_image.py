"""The kv-epp image's Dockerfile and .dockerignore against what they install and what the chart expects.

No Docker engine runs here, so the image is never built by the tests (checkov lints the Dockerfile:
test_checkov.py). What can be checked without building it is checked here: the build context holds every
file the install needs (pyproject's packages and readme), the install has no test extras, the base is pinned to a
Python patch release matching ``requires-python``, the runtime user is the chart's UID/GID, the entry points the
chart's containers run exist, and no runtime instruction needs a shell.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from charts import chart_variants as cv

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in DOCKERFILE.splitlines() if not line.startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def context_patterns() -> list[str]:
    return [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    ]


def test_the_build_context_holds_what_the_install_needs() -> None:
    patterns = context_patterns()
    assert patterns[0] == "*"  # an allow-list: nothing else (.venv, .git, out, tests) enters the context
    allowed = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    build = stages()[0]
    copied = {src for word, args in build if word == "COPY" for src in args.split()[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *packages}
    assert needed <= copied and copied <= allowed, (needed, copied, allowed)
    assert all((ROOT / src).exists() for src in copied)


def test_the_install_has_no_test_extras_and_checks_its_entry_points() -> None:
    build = stages()[0]
    (default,) = [args for word, args in build if word == "ARG" and args.startswith("KV_EPP_INSTALL=")]
    assert default == "KV_EPP_INSTALL=."
    (run,) = [args for word, args in build if word == "RUN" and "pip install" in args]
    assert '"${KV_EPP_INSTALL}"' in run and "test" not in run
    scripts = PYPROJECT["project"]["scripts"]
    for program in ("kv-epp", "kv-listener"):
        assert program in scripts and f"/opt/kv-epp/bin/{program} --help" in run


def test_the_base_is_a_pinned_python_release_that_the_project_supports() -> None:
    bases = [args.split()[0] for word, args in instructions() if word == "FROM"]
    assert len(bases) == 2 and len(set(bases)) == 1, bases  # the venv's interpreter is the runtime's
    m = re.fullmatch(r"python:(3)\.(\d+)\.(\d+)-slim-bookworm(@sha256:[0-9a-f]{64})?", bases[0])
    assert m, bases[0]
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert (int(m[1]), int(m[2])) >= tuple(int(x) for x in minimum.split("."))


def test_the_runtime_runs_as_the_charts_user_without_a_shell() -> None:
    runtime = stages()[-1]
    users = [args for word, args in runtime if word == "USER"]
    assert users and users[-1] == "65532:65532"
    pod = yaml.safe_load((cv.CHART / "templates" / "_helpers.tpl").read_text().split('"kv-epp.podSecurityContext"')[1]
                         .split("-}}", 1)[1].split("{{- end", 1)[0])  # fmt: skip
    assert (pod["runAsUser"], pod["runAsGroup"]) == (65532, 65532)
    env = " ".join(args for word, args in runtime if word == "ENV")
    assert "PATH=/opt/kv-epp/bin:" in env and "PYTHONDONTWRITEBYTECODE=1" in env  # read-only root filesystem
    for word, args in runtime:
        if word in ("CMD", "ENTRYPOINT"):
            assert args.startswith("["), f"{word} {args}: exec form (no shell at runtime)"
    objs = cv.objects(cv.values_of("kv-aware"))
    containers = [c for d in objs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    commands = {c["name"]: c["command"] for c in containers if c["name"] in ("picker", "listener")}
    assert commands == {"picker": ["kv-epp"], "listener": ["kv-listener"]}  # on the image's PATH
