"""``kv-epp conformance`` as an operator runs it (the CLI, a subprocess) against real ext_proc servers: a real
kv-epp picker passes every case in both body modes, over TLS with a bearer token; the overhead benchmark's no-op
server (benchmarks/noop_extproc.py) fails in a stated way. The kit's own checks: tests/unit/picker/conformance."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from benchmarks.stack import PickerProcess, free_port, spawn_ready_line, start_picker
from tests.integration.conftest import Backends, start_backends
from tests.support.certs import server_certificate
from tests.support.ready_process import run_cli

# The no-op floor does the ext_proc protocol and nothing else: no subset hint, no body parse, no named health
# services. These are the cases it fails, in each body mode; every other case passes.
NOOP_FAILS = {"health"} | {
    f"{m}/{c}" for m in ("full_duplex", "buffered") for c in ("subset", "subset_empty", "malformed")
}


@pytest.fixture(scope="module")
def backends(workdir: Path) -> Iterator[Backends]:
    b = start_backends(3, workdir)
    try:
        yield b
    finally:
        b.process.stop()


@pytest.fixture(scope="module")
def picker(backends: Backends, workdir: Path) -> Iterator[PickerProcess]:
    token = workdir / "conformance-token"
    token.write_text("conformance-secret-token\n")
    # TLS (the picker's default self-signed certificate) and a bearer token, as a gateway reaches it. The default
    # body mode is BUFFERED: the kit announces each stream's mode (protocol_config), so full-duplex streams are
    # full duplex all the same.
    config = {
        "pool": {"backends": backends.pool()},
        "extproc": {"auth": {"token_file": str(token)}, "default_body_mode": "BUFFERED", "health_port": free_port()},
    }
    p = start_picker(config, workdir, name="picker-conformance")
    try:
        yield p
    finally:
        p.stop()


def kit(*argv: str) -> tuple[int, list[str]]:
    out = run_cli(["-m", "picker", "conformance", *argv], timeout=120)
    assert not out.stderr.strip() or "error" not in out.stderr, out.stderr
    return out.returncode, out.stdout.splitlines()


def test_kv_epp_passes_every_case_in_both_body_modes(picker: PickerProcess, backends: Backends, workdir: Path) -> None:
    endpoints = ",".join(backends.address(i) for i in range(3))
    rc, lines = kit(
        "--target", f"127.0.0.1:{picker.extproc_port}", "--insecure",
        "--token-file", str(workdir / "conformance-token"), "--endpoints", endpoints,
        "--health", f"127.0.0.1:{picker.config['extproc']['health_port']}",  # GIE's layout: a plaintext health port
    )  # fmt: skip
    cases = lines[:-1]
    assert rc == 0, "\n".join(lines)
    assert all(line.startswith("PASS ") for line in cases), "\n".join(lines)
    names = {line.split(" ")[1] for line in cases}
    for mode in ("full_duplex", "buffered"):
        assert {
            f"{mode}/{c}" for c in ("destination", "body", "subset", "subset_empty", "malformed", "aborted")
        } <= names
    fallbacks = next(line for line in cases if line.startswith("PASS full_duplex/fallbacks"))
    assert "ranked lists of up to 3 distinct endpoints" in fallbacks  # pool.fallbacks: 2 after the pick
    assert lines[-1].startswith(f"summary: {len(cases)} PASS, 0 FAIL, 0 SKIP")


def test_kv_epp_without_the_token_fails_every_stream_case(picker: PickerProcess, workdir: Path) -> None:
    ca = workdir / "picker-certificate.pem"  # its self-signed certificate, verified as a CA bundle (--ca)
    ca.write_bytes(server_certificate(picker.extproc_port).public_bytes(serialization.Encoding.PEM))
    target = f"127.0.0.1:{picker.extproc_port}"
    rc, lines = kit("--target", target, "--ca", str(ca), "--body-mode", "buffered", "--json")
    doc = json.loads("\n".join(lines))
    by_name = {c["name"]: c for c in doc["cases"]}
    assert rc == 1 and doc["passed"] is False
    assert by_name["connect"]["status"] == "PASS"  # the certificate verified against --ca
    assert by_name["health"]["status"] == "PASS"  # health checks need no token (kubelet and Envoy probe them)
    streams = [c for name, c in by_name.items() if name == "pool" or name.startswith("buffered/")]
    for case in streams:
        if case["name"] == "buffered/subset":  # no endpoint was learned: nothing to hint
            assert case["status"] == "SKIP", case
        else:
            # refused at the stream's start: the status, or (a write that lost the race) the kit's reading of it
            assert case["status"] == "FAIL", case
            assert "UNAUTHENTICATED" in case["detail"] or "closed the stream before" in case["detail"], case


def test_the_noop_ext_proc_server_fails_in_a_stated_way(workdir: Path) -> None:
    pool = ["127.0.0.1:18001", "127.0.0.1:18002"]  # the floor only names them: nothing is sent there
    argv = [sys.executable, "-m", "benchmarks.noop_extproc", "--dest", ",".join(pool)]
    proc, line = spawn_ready_line("noop-conformance", argv, workdir, "noop-extproc ready")
    try:
        target = line.rpartition("extproc=")[2].strip()
        rc, lines = kit("--target", target, "--endpoints", ",".join(pool))
    finally:
        proc.stop()
    results = {line.split(" ")[1]: line for line in lines[:-1]}
    failed = {name for name, line in results.items() if line.startswith("FAIL ")}
    assert rc == 1
    assert failed == NOOP_FAILS, "\n".join(lines)
    assert "liveness: NOT_FOUND" in results["health"]
    assert "outside the subset hint" in results["full_duplex/subset"]
    assert "an empty subset: routed to" in results["buffered/subset_empty"]
    assert "non-JSON body routed to" in results["full_duplex/malformed"]
    assert "no fallbacks offered" in results["full_duplex/fallbacks"]  # one endpoint per pick: a note, not a FAIL
    assert all(line.startswith("PASS ") for name, line in results.items() if name not in NOOP_FAILS)
