"""checkov (a security lint) on every documented variant of the rendered chart and on the image's Dockerfile (the
repository root's, which the chart's image is built from): no failed check except the ones the chart README
justifies (its "Security lint" table, read here), and every row of that table still fires (no stale justification).

checkov lives in its own venv (it pins older packages than the project): ``$KV_EPP_CHECKOV`` (``make test`` sets
it), else ``.venv-checkov/bin/checkov``; without either the test is skipped, naming ``make test``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from charts import chart_variants as cv

ROOT = Path(__file__).resolve().parents[3]
README = cv.CHART / "README.md"
DOCKERFILE = ROOT / "Dockerfile"


def checkov_binary() -> str:
    configured = os.environ.get("KV_EPP_CHECKOV")
    if configured:
        path = Path(configured) if Path(configured).is_absolute() else ROOT / configured
        assert path.exists(), f"KV_EPP_CHECKOV={configured}: no such file"
        return str(path)
    local = ROOT / ".venv-checkov" / "bin" / "checkov"
    if local.exists():
        return str(local)
    pytest.skip("checkov is not installed: `make test` installs it into .venv-checkov and sets KV_EPP_CHECKOV")


def justified() -> dict[str, str]:
    """check id -> justification, from the README's table between the checkov markers."""
    table = README.read_text().split("<!-- checkov:begin -->", 1)[1].split("<!-- checkov:end -->", 1)[0]
    rows = re.findall(r"^\| (CKV2?_[A-Z0-9_]+) \| [^|]+ \| ([^|]+) \|$", table, flags=re.MULTILINE)
    return {check: why.strip() for check, why in rows}


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """check id -> the resources it failed on, over every variant."""
    binary = checkov_binary()
    out_dir = tmp_path_factory.mktemp("manifests")
    for name in cv.VARIANTS:
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump_all(cv.objects(cv.values_of(name))))
    (out_dir / "Dockerfile").write_text(DOCKERFILE.read_text())
    run = subprocess.run(
        [binary, "-d", str(out_dir), "--framework", "kubernetes", "dockerfile", "-o", "json", "--compact",
         "--quiet", "--skip-download"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: some check failed
    reports: Any = json.loads(run.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    scanned = {r["check_type"]: r["summary"] for r in reports}
    assert set(scanned) == {"kubernetes", "dockerfile"}, scanned  # both frameworks found their files
    for summary in scanned.values():
        assert summary["resource_count"] > 0 and summary["parsing_errors"] == 0, summary
    failed: dict[str, set[str]] = {}
    for report in reports:
        for check in report["results"]["failed_checks"]:
            failed.setdefault(check["check_id"], set()).add(f"{check['file_path']}: {check['resource']}")
    return failed


def test_every_justification_says_why() -> None:
    rows = justified()
    assert rows and all(len(why) > 40 for why in rows.values())


def test_checkov_finds_nothing_unjustified(findings: dict[str, set[str]]) -> None:
    unjustified = {check: sorted(where) for check, where in findings.items() if check not in justified()}
    assert not unjustified, f"fix these or justify them in {README.relative_to(ROOT)}: {unjustified}"


def test_every_justified_finding_still_fires(findings: dict[str, set[str]]) -> None:
    stale = sorted(set(justified()) - set(findings))
    assert not stale, f"no longer found, remove from the README's Security lint table: {stale}"
