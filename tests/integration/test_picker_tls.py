"""TLS and token authentication on the ext_proc port (issue 9): real `kv-epp serve` processes, free ports,
real TLS handshakes, and the real Envoy with the bootstrap `kv-epp envoy-config` prints."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.stack import envoy_binary, free_port, spawn_ready
from tests.integration.conftest import http, start_backends
from tests.support.certs import TestCA, server_certificate, sha256_hex, write_pair
from tests.support.ready_process import CliProcess, poll, run_cli, start_cli, write_yaml

SERVING = health_pb2.HealthCheckResponse.SERVING
BACKEND = {"name": "be-0", "address": "127.0.0.1:9"}  # never contacted: the picker only names it
TOKEN = "s3cret-token-for-tests"


def picker_config(**extproc: Any) -> dict[str, Any]:
    return {
        "pool": {"backends": [BACKEND]},
        "extproc": {"host": "127.0.0.1", "port": free_port(), "health_port": free_port(), **extproc},
        "admin": {"port": free_port()},
    }


def serve(cfg: dict[str, Any], workdir: Path, name: str) -> tuple[CliProcess, str]:
    proc = start_cli(
        ["-m", "picker", "serve", "--config", str(write_yaml(workdir / f"{name}.yaml", cfg))], workdir, name
    )
    return proc, proc.read_line()


def health(channel: grpc.Channel, service: str = "readiness") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


def tls_channel(port: int, roots: bytes, client: tuple[bytes, bytes] | None = None) -> grpc.Channel:
    key, chain = (client[1], client[0]) if client else (None, None)
    creds = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def ext_proc_stream(channel: grpc.Channel, metadata: list[tuple[str, str]] | None = None) -> list[str]:
    """One ext_proc stream (a body-less GET): the kinds of the picker's answers; raises grpc.RpcError if refused."""
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in ((":path", "/v1/models"), (":method", "GET"))]
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=True)
    )
    stub = pb_grpc.ExternalProcessorStub(channel)
    return [str(r.WhichOneof("response")) for r in stub.Process(iter([req]), metadata=metadata, timeout=20)]


def test_tls_by_default_refuses_plaintext_and_serves_a_client_trusting_the_generated_cert(workdir: Path) -> None:
    cfg = picker_config()
    port, health_port = cfg["extproc"]["port"], cfg["extproc"]["health_port"]
    picker, line = serve(cfg, workdir, "tls-default")
    try:
        assert line.endswith(" tls=on")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as refused:
            health(ch)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on the ext_proc port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
            ext_proc_stream(ch)

        cert = server_certificate(port)  # the generated certificate, as a client pinning it first sees it
        logged = re.search(r"event=picker_started .*tls=on cert=generated serial=(\w+) sha256=(\w+)", picker.stderr())
        assert logged is not None and logged.group(2) == sha256_hex(cert)
        assert logged.group(1) == format(cert.serial_number, "x")
        roots = ssl.get_server_certificate(("127.0.0.1", port)).encode()  # trust on first use
        with tls_channel(port, roots) as ch:
            assert health(ch) == SERVING
            assert ext_proc_stream(ch)  # the picker answered the stream
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:  # kubelet-style plaintext probe
            assert health(ch) == SERVING and health(ch, "inference-extension") == SERVING
            with pytest.raises(grpc.RpcError):  # the health port serves only health
                ext_proc_stream(ch)
        assert "BEGIN" not in picker.stderr()  # no key or certificate in the logs
        assert "Handshake failed" not in picker.stderr()  # gRPC core's INFO line per refused plaintext client
    finally:
        assert picker.stop() == 0


def test_mounted_certificate_is_reloaded_on_rotation_without_restart(workdir: Path) -> None:
    ca = TestCA()
    cert_path, key_path = workdir / "rot-tls.crt", workdir / "rot-tls.key"
    first, second = ca.issue("picker-1"), ca.issue("picker-2")
    write_pair(first, cert_path, key_path)
    cfg = picker_config(tls={"cert_file": str(cert_path), "key_file": str(key_path)})
    port = cfg["extproc"]["port"]
    picker, line = serve(cfg, workdir, "tls-rotate")
    try:
        assert line.endswith(" tls=on")
        assert server_certificate(port).serial_number == first.serial
        old = tls_channel(port, ca.pem)
        assert health(old) == SERVING

        write_pair(second, cert_path, key_path)
        poll(lambda: server_certificate(port).serial_number == second.serial, "a new connection to see the new cert")
        with tls_channel(port, ca.pem) as ch:
            assert ext_proc_stream(ch)
        assert health(old) == SERVING  # an open connection keeps working
        old.close()
        assert picker.proc.poll() is None  # same process: no restart
        assert f"event=tls_certificate_reloaded serial={second.serial:x}" in picker.stderr()

        cert_path.write_bytes(b"not a certificate")  # a broken rotation keeps the current certificate

        def failed_reload_seen() -> bool:  # the fetcher runs at a handshake: connect, then read the log
            assert server_certificate(port).serial_number == second.serial
            return "not a PEM certificate" in picker.stderr()

        poll(failed_reload_seen, "the failed reload to be logged", every=0.2)
    finally:
        assert picker.stop() == 0


def test_client_certificate_required_when_a_ca_is_configured(workdir: Path) -> None:
    ca = TestCA()
    server = ca.issue("picker")
    (workdir / "mtls.crt").write_bytes(server.cert_pem)
    (workdir / "mtls.key").write_bytes(server.key_pem)
    tls = {"cert_file": str(workdir / "mtls.crt"), "key_file": str(workdir / "mtls.key")}
    tls["client_ca_file"] = str(ca.write_ca(workdir / "mtls-ca.pem"))
    cfg = picker_config(tls=tls)
    picker, _ = serve(cfg, workdir, "tls-mtls")
    try:
        port = cfg["extproc"]["port"]
        with tls_channel(port, ca.pem) as ch, pytest.raises(grpc.RpcError):
            health(ch)  # no client certificate: the handshake fails
        stranger = TestCA("another CA").issue("envoy", client=True)
        with tls_channel(port, ca.pem, (stranger.cert_pem, stranger.key_pem)) as ch, pytest.raises(grpc.RpcError):
            health(ch)
        envoy = ca.issue("envoy", client=True)
        with tls_channel(port, ca.pem, (envoy.cert_pem, envoy.key_pem)) as ch:
            assert health(ch) == SERVING and ext_proc_stream(ch)
    finally:
        assert picker.stop() == 0


def test_token_required_before_a_stream_does_any_work(workdir: Path) -> None:
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = picker_config(auth={"token_file": str(token_file)})
    picker, _ = serve(cfg, workdir, "tls-token")
    try:
        port = cfg["extproc"]["port"]
        roots = ssl.get_server_certificate(("127.0.0.1", port)).encode()
        with tls_channel(port, roots) as ch:
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                with pytest.raises(grpc.RpcError) as refused:
                    ext_proc_stream(ch, metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ext_proc_stream(ch, [("authorization", f"Bearer {TOKEN}")])
            assert ext_proc_stream(ch, [("authorization", f"bearer {TOKEN}")])  # the scheme in any case
            assert health(ch) == SERVING  # probes carry no token
        assert TOKEN not in picker.stderr()
    finally:
        assert picker.stop() == 0
    stopped = re.search(r"event=picker_stopped .*unauthenticated=(\d+)", picker.stderr())
    assert stopped is not None and int(stopped.group(1)) == 3


def test_plaintext_only_when_configured(workdir: Path) -> None:
    cfg = picker_config(tls={"mode": "plaintext"})
    picker, line = serve(cfg, workdir, "tls-off")
    try:
        assert line.endswith(" tls=off")
        with grpc.insecure_channel(f"127.0.0.1:{cfg['extproc']['port']}") as ch:
            assert health(ch) == SERVING and ext_proc_stream(ch)
        assert "tls=off" in picker.stderr()
    finally:
        assert picker.stop() == 0


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": "/nonexistent/tls.crt", "key_file": "/nonexistent/tls.key"}, "No such file"),
        ({"cert_file": "{other_crt}", "key_file": "{key}"}, "does not match"),
        ({"client_ca_file": "/nonexistent/ca.pem"}, "No such file"),
    ],
)
def test_unusable_certificate_is_one_error_line_and_exit_2(tls: dict[str, str], message: str, workdir: Path) -> None:
    ca = TestCA()
    a, b = ca.issue("a"), ca.issue("b")
    (workdir / "bad-a.crt").write_bytes(a.cert_pem)
    (workdir / "bad-b.key").write_bytes(b.key_pem)
    paths = {"other_crt": str(workdir / "bad-a.crt"), "key": str(workdir / "bad-b.key")}
    tls = {k: v.format(**paths) for k, v in tls.items()}
    path = write_yaml(workdir / "bad-tls.yaml", picker_config(tls=tls))
    out = run_cli(["-m", "picker", "serve", "--config", str(path)])
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ext_proc tls: ") and message in lines[0], out.stderr


def envoy_config(args: list[str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "picker", "envoy-config", *args], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.envoy
def test_envoy_verifies_the_picker_and_sends_the_token_end_to_end(workdir: Path) -> None:
    """`kv-epp envoy-config --picker-ca --picker-token-file` against a picker with a mounted certificate
    and a token: a request through the real Envoy is routed by the picker and served by the backend."""
    ca = TestCA()
    server = ca.issue("picker")
    write_pair(server, workdir / "e2e-tls.crt", workdir / "e2e-tls.key")
    (workdir / "e2e-token").write_text(TOKEN)
    backends = start_backends(1, workdir)
    cfg = picker_config(
        tls={"cert_file": str(workdir / "e2e-tls.crt"), "key_file": str(workdir / "e2e-tls.key")},
        auth={"token_file": str(workdir / "e2e-token")},
    )
    cfg["pool"] = {"backends": backends.pool()}
    picker, _ = serve(cfg, workdir, "tls-e2e")
    envoys = []
    try:
        ca_file = str(ca.write_ca(workdir / "e2e-ca.pem"))
        verified = ["--picker-ca", ca_file, "--picker-token-file", str(workdir / "e2e-token")]
        for name, extra in (("verified", verified), ("no-token", [])):
            listen, admin = free_port(), free_port()
            text = envoy_config(
                ["--mode", "standalone", "--picker", f"127.0.0.1:{cfg['extproc']['port']}",
                 "--backend", backends.address(0), "--listen-address", "127.0.0.1", "--listen-port", str(listen),
                 "--admin-port", str(admin), *extra]
            )  # fmt: skip
            path = workdir / f"envoy-tls-{name}.yaml"
            path.write_text(text)
            argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"]
            envoys.append(spawn_ready(f"envoy-tls-{name}", argv, workdir, f"http://127.0.0.1:{admin}/ready"))
            body = {"model": "m", "messages": [{"role": "user", "content": "over TLS"}]}
            r = http("POST", f"http://127.0.0.1:{listen}/v1/chat/completions", body)
            if name == "verified":
                assert r.status == 200 and r.headers["x-backend"] == "be-0", r
            else:
                assert r.status >= 500  # Envoy without the token is refused by the picker (fail closed)
        assert TOKEN not in picker.stderr()
    finally:
        for e in envoys:
            e.stop()
        assert picker.stop() == 0
        backends.process.stop()


@pytest.mark.envoy
@pytest.mark.parametrize("variant", ["default", "plaintext", "ca-token", "standalone-mtls"])
def test_envoy_config_tls_variants_are_accepted_by_envoy(variant: str, tmp_path: Path) -> None:
    ca = TestCA()
    client = ca.issue("envoy", client=True)
    (tmp_path / "client.crt").write_bytes(client.cert_pem)
    (tmp_path / "client.key").write_bytes(client.key_pem)
    (tmp_path / "token").write_text(TOKEN + "\n")
    ca_file = str(ca.write_ca(tmp_path / "ca.pem"))
    args = {
        "default": [],
        "plaintext": ["--picker-plaintext"],
        "ca-token": ["--picker-ca", ca_file, "--picker-token-file", str(tmp_path / "token")],
        "standalone-mtls": [
            "--mode", "standalone", "--picker", "kv-epp.default.svc:9002", "--picker-ca", ca_file,
            "--picker-client-cert", str(tmp_path / "client.crt"), "--picker-client-key", str(tmp_path / "client.key"),
        ],
    }[variant]  # fmt: skip
    text = envoy_config(["--backend", "10.0.0.1:8000", *args])
    cfg = yaml.safe_load(text)
    (picker,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "kv_epp_picker"]
    socket = picker.get("transport_socket")
    if variant == "plaintext":
        assert socket is None
    else:
        ctx = socket["typed_config"]
        assert socket["name"] == "envoy.transport_sockets.tls" and ctx["common_tls_context"]["alpn_protocols"] == ["h2"]
        validation = ctx["common_tls_context"].get("validation_context")
        if variant == "default":
            assert validation is None and "sni" not in ctx  # no CA given: the picker's certificate is not verified
        elif variant == "ca-token":
            assert validation["trusted_ca"] == {"filename": ca_file}
            assert validation["match_typed_subject_alt_names"] == [
                {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
            ]
        else:
            assert ctx["sni"] == "kv-epp.default.svc"
            assert validation["match_typed_subject_alt_names"][0]["matcher"] == {"exact": "kv-epp.default.svc"}
            assert ctx["common_tls_context"]["tls_certificates"][0]["private_key"] == {
                "filename": str(tmp_path / "client.key")
            }
    ext_proc = [
        f
        for listener in cfg["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for net in chain["filters"]
        for f in net["typed_config"].get("http_filters", [])
        if f["name"] == "envoy.filters.http.ext_proc"
    ]
    metadata = ext_proc[0]["typed_config"]["grpc_service"].get("initial_metadata")
    if variant == "ca-token":
        assert metadata == [{"key": "authorization", "value": f"Bearer {TOKEN}"}]
    else:
        assert metadata is None
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    v = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--picker-plaintext", "--picker-ca", "ca.pem"],
        ["--picker-client-cert", "c.pem"],
        ["--picker-token-file", "/nonexistent/token"],
    ],
)
def test_envoy_config_bad_tls_flags_are_one_error_line(args: list[str]) -> None:
    out = run_cli(["-m", "picker", "envoy-config", "--backend", "10.0.0.1:8000", *args])
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("error: --picker-"), out.stderr
