"""No anonymous peer can hold a lease (issue 21): real `kv-epp serve` processes, real gRPC and TLS, the real Envoy,
free ports.

- The ext_proc port binds loopback by default.
- Beyond loopback, the picker refuses to start without client authentication (a token or client certificates),
  naming the key; with ``extproc.auth.allow_unauthenticated`` it starts and warns (log and ``/readyz``).
- A peer without the token cannot open a stream, whether it trusts the picker's certificate or not, and holds no
  lease (the pool's in-flight stays 0) however many streams it tries; with the token the same client can.
- The per-peer cap refuses the stream over it (RESOURCE_EXHAUSTED, counted, no lease).
- The chart's defaults: the token of its Secret in the picker, Envoy's bootstrap (rendered by the chart) sending it:
  the real Envoy routes through a picker bound beyond loopback; the same Envoy without the token is refused.

"Beyond loopback": the picker binds 0.0.0.0, every interface (beyond loopback by the rule on every machine); where
this machine has an address beyond loopback, clients also connect through it and the picker binds it alone. On a
machine without one those cases are skipped, saying so (the 0.0.0.0 cases still run from 127.0.0.1)."""

from __future__ import annotations

import base64
import copy
import ipaddress
import json
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from benchmarks.stack import ManagedProcess, envoy_binary, free_port, spawn_ready
from charts import chart_variants as cv
from tests.integration.conftest import http, start_backends
from tests.support.certs import TestCA, write_pair
from tests.support.ready_process import CliProcess, poll, run_cli, start_cli, write_yaml

TOKEN = "issue-21-token-for-tests"


def own_address() -> str | None:
    """An address of this machine beyond loopback that a socket can bind, or None: the source address of the
    routes to documentation addresses (a UDP connect sends nothing), then the host name's addresses."""
    candidates: list[str] = []
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                candidates.append(str(s.getsockname()[0]))
        except OSError:
            pass
    try:
        candidates += [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:
        pass
    for address in candidates:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
            continue
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
        except OSError:
            continue
        return address
    return None


OWN = own_address()
NO_OWN = "this machine has no address beyond loopback: the same checks ran on 0.0.0.0 from 127.0.0.1"


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@pytest.fixture(scope="module")
def pool(workdir: Path) -> Iterator[list[dict[str, Any]]]:
    """One echo backend: the clients here are raw gRPC and never reach it, but the picker's active health probes
    an endpoint whose client gave up before the first byte (these tests close held streams), and it answers."""
    backends = start_backends(1, workdir)
    try:
        yield backends.pool()
    finally:
        backends.process.stop()


def picker_config(pool: list[dict[str, Any]], host: str | None, **extproc: Any) -> dict[str, Any]:
    x: dict[str, Any] = {"port": free_port(), "health_port": free_port(), **extproc}
    if host is not None:
        x["host"] = host
    return {"pool": {"backends": pool}, "extproc": x, "admin": {"port": free_port()}}


def serve(cfg: dict[str, Any], workdir: Path, name: str) -> tuple[CliProcess, str]:
    proc = start_cli(
        ["-m", "picker", "serve", "--config", str(write_yaml(workdir / f"{name}.yaml", cfg))], workdir, name
    )
    return proc, proc.read_line()


def admin(cfg: dict[str, Any], path: str) -> Any:
    return http("GET", f"http://127.0.0.1:{cfg['admin']['port']}{path}").json()


def in_flight(cfg: dict[str, Any]) -> int:
    return sum(int(b["in_flight_requests"]) for b in admin(cfg, "/admin/pool")["backends"])


def refused_streams(cfg: dict[str, Any], reason: str) -> float:
    text = http("GET", f"http://127.0.0.1:{cfg['admin']['port']}/metrics").body.decode()
    m = re.search(rf'^continuum_picker_extproc_refused_streams_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def channel(address: str, roots: bytes | None, *, trusted_name: str = "localhost") -> grpc.Channel:
    """TLS to ``address`` trusting ``roots`` (None: the system's CAs, which do not hold the picker's self-signed
    certificate); its name checked as ``trusted_name`` (the generated certificate names localhost)."""
    creds = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", trusted_name)])


def bodyless_get() -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in ((":path", "/v1/models"), (":method", "GET"))]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=True)
    )


class HeldStream:
    """An ext_proc stream that sent a body-less GET's headers (routed at once: it holds an in-flight lease once
    answered) and stays open until ``close``, as the hostile peer of the issue held its 300."""

    def __init__(self, ch: grpc.Channel, metadata: list[tuple[str, str]] | None = None) -> None:
        self._done = threading.Event()

        def requests() -> Iterator[pb.ProcessingRequest]:
            yield bodyless_get()
            self._done.wait(60)

        self.call = pb_grpc.ExternalProcessorStub(ch).Process(requests(), metadata=metadata, timeout=60)

    def first(self) -> str:
        """The kind of the picker's first answer; raises grpc.RpcError when the stream is refused."""
        return str(next(self.call).WhichOneof("response"))

    def close(self) -> None:
        self._done.set()
        self.call.cancel()


def refusal(ch: grpc.Channel, metadata: list[tuple[str, str]] | None = None) -> grpc.StatusCode:
    stream = HeldStream(ch, metadata)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream.first()
        code: grpc.StatusCode = err.value.code()
        return code
    finally:
        stream.close()


def roots_of(address: str) -> bytes:
    """The certificate the picker serves, trusted on first use (what the issue's hostile peer did)."""
    host, _, port = address.rpartition(":")
    return ssl.get_server_certificate((host.strip("[]"), int(port))).encode()


# -- the default binds loopback ------------------------------------------------------------------------------


def test_the_default_binds_loopback_only(pool: list[dict[str, Any]], workdir: Path) -> None:
    cfg = picker_config(pool, None)
    picker, line = serve(cfg, workdir, "exposure-default")
    port = cfg["extproc"]["port"]
    try:
        assert f" extproc=127.0.0.1:{port} " in line and f" health=127.0.0.1:{cfg['extproc']['health_port']} " in line
        assert admin(cfg, "/readyz")["extproc"] == {
            "host": "127.0.0.1", "loopback": True, "client_auth": [], "max_streams_per_peer": 4096,
        }  # fmt: skip
        if OWN is not None:  # the machine's own address beyond loopback: nothing listens there
            with socket.socket(socket.AF_INET6 if ":" in OWN else socket.AF_INET) as s:
                s.settimeout(5)
                assert s.connect_ex((OWN, port)) != 0
        assert "config_warning" not in picker.stderr()
    finally:
        assert picker.stop() == 0


# -- beyond loopback without client authentication: refused, or allowed and warned ----------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "own"])
def test_beyond_loopback_without_authentication_is_refused_naming_the_key(
    host: str, pool: list[dict[str, Any]], workdir: Path
) -> None:
    if host == "own":
        if OWN is None:
            pytest.skip(NO_OWN)
        host = OWN
    cfg = picker_config(pool, host)
    path = write_yaml(workdir / "exposed.yaml", cfg)
    for argv in (["serve", "--config", str(path)], ["config", "validate", str(path)]):
        out = run_cli(["-m", "picker", *argv])
        assert out.returncode == 2 and out.stdout == "", out
        (line,) = out.stderr.splitlines()
        assert line.startswith(f"error: extproc.host: {host!r} is beyond loopback"), line
        for key in ("extproc.auth.token_file", "extproc.tls.client_ca_file", "extproc.auth.allow_unauthenticated"):
            assert key in line, key


def test_client_certificates_are_client_authentication_too(pool: list[dict[str, Any]], workdir: Path) -> None:
    ca = TestCA()
    write_pair(ca.issue("picker"), workdir / "exposure-mtls.crt", workdir / "exposure-mtls.key")
    tls = {"cert_file": str(workdir / "exposure-mtls.crt"), "key_file": str(workdir / "exposure-mtls.key")}
    cfg = picker_config(pool, "0.0.0.0", tls={**tls, "client_ca_file": str(ca.write_ca(workdir / "exposure-ca.pem"))})
    picker, line = serve(cfg, workdir, "exposure-mtls")
    try:
        assert line.startswith("kv-epp ready extproc=0.0.0.0:")
        assert admin(cfg, "/readyz")["extproc"]["client_auth"] == ["client_cert"]
        with channel(f"127.0.0.1:{cfg['extproc']['port']}", ca.pem) as ch:  # trusts the server, no client cert
            assert refusal(ch) == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no stream at all
        assert in_flight(cfg) == 0
    finally:
        assert picker.stop() == 0


def test_allow_unauthenticated_starts_and_warns_in_the_log_and_readyz(
    pool: list[dict[str, Any]], workdir: Path
) -> None:
    cfg = picker_config(pool, "0.0.0.0", auth={"allow_unauthenticated": True})
    picker, line = serve(cfg, workdir, "exposure-allowed")
    try:
        assert line.startswith("kv-epp ready extproc=0.0.0.0:")
        warned = [x for x in picker.stderr().splitlines() if "path=extproc.auth.allow_unauthenticated" in x]
        assert len(warned) == 1 and "level=WARNING" in warned[0] and "steer routing" in warned[0], picker.stderr()
        detail = admin(cfg, "/readyz")["extproc"]
        assert detail["loopback"] is False and detail["client_auth"] == []
        assert "allow_unauthenticated" in detail["warning"] and "hold in-flight leases" in detail["warning"]
        address = f"127.0.0.1:{cfg['extproc']['port']}"
        with channel(address, roots_of(address)) as ch:  # what the warning says: anyone may
            held = HeldStream(ch)
            assert held.first() == "request_headers"
            assert in_flight(cfg) == 1
            held.close()
        poll(lambda: in_flight(cfg) == 0, "the lease released")
    finally:
        assert picker.stop() == 0


# -- a peer without the token holds nothing --------------------------------------------------------------------


@pytest.mark.parametrize("bind", ["0.0.0.0", "own"])
def test_a_peer_without_the_token_cannot_open_a_stream_trusted_tls_or_not(
    bind: str, pool: list[dict[str, Any]], workdir: Path
) -> None:
    """The issue's attack, through the real gRPC and TLS: a peer that fetched the picker's certificate and trusts
    it opens streams with request headers only and holds them. Without the token every one is refused before it
    reaches the picker (UNAUTHENTICATED) and the pool's in-flight stays 0; so are a plaintext client and one that
    does not trust the certificate (the handshake). The same client with the token holds its leases."""
    if bind == "own" and OWN is None:
        pytest.skip(NO_OWN)
    (workdir / "exposure-token").write_text(TOKEN + "\n")
    host = OWN if bind == "own" else "0.0.0.0"
    assert host is not None
    cfg = picker_config(pool, host, auth={"token_file": str(workdir / "exposure-token")})
    picker, _ = serve(cfg, workdir, f"exposure-token-{bind}")
    try:
        port = cfg["extproc"]["port"]
        targets = [hostport(OWN, port)] if OWN is not None else []
        if bind == "0.0.0.0":
            targets.append(f"127.0.0.1:{port}")
        for address in targets:
            roots = roots_of(address)
            with grpc.insecure_channel(address) as ch:
                assert refusal(ch) == grpc.StatusCode.UNAVAILABLE  # plaintext: refused by TLS
            with channel(address, None) as ch:
                assert refusal(ch) == grpc.StatusCode.UNAVAILABLE  # the picker's certificate is not trusted
            with channel(address, roots) as ch:
                for metadata in (None, [("authorization", "Bearer not-the-token")], [("authorization", TOKEN)]):
                    assert refusal(ch, metadata) == grpc.StatusCode.UNAUTHENTICATED
                held = [HeldStream(ch) for _ in range(20)]  # the attack, 20 streams held open
                try:
                    for h in held:
                        with pytest.raises(grpc.RpcError) as err:
                            h.first()
                        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert in_flight(cfg) == 0  # no lease anywhere
                finally:
                    for h in held:
                        h.close()
                allowed = [HeldStream(ch, [("authorization", f"Bearer {TOKEN}")]) for _ in range(3)]
                try:
                    assert [h.first() for h in allowed] == ["request_headers"] * 3
                    assert in_flight(cfg) == 3  # the token holder is served (and holds its leases)
                finally:
                    for h in allowed:
                        h.close()
                poll(lambda: in_flight(cfg) == 0, "the token holder's leases released")
        assert refused_streams(cfg, "unauthenticated") == 23 * len(targets)
        assert TOKEN not in picker.stderr()
    finally:
        assert picker.stop() == 0


# -- the per-peer cap ---------------------------------------------------------------------------------------------


def test_the_stream_over_the_per_peer_cap_is_refused_and_holds_no_lease(
    pool: list[dict[str, Any]], workdir: Path
) -> None:
    cfg = picker_config(pool, None, max_streams_per_peer=3)
    picker, _ = serve(cfg, workdir, "exposure-peer-cap")
    try:
        assert "path=extproc.max_streams_per_peer" in picker.stderr()  # below admission.max_open_streams: warned
        address = f"127.0.0.1:{cfg['extproc']['port']}"
        with channel(address, roots_of(address)) as ch:
            held = [HeldStream(ch) for _ in range(3)]
            try:
                assert [h.first() for h in held] == ["request_headers"] * 3
                assert in_flight(cfg) == 3
                over = HeldStream(ch)
                with pytest.raises(grpc.RpcError) as err:
                    over.first()
                over.close()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "extproc.max_streams_per_peer" in (err.value.details() or "")
                assert in_flight(cfg) == 3  # the refused stream holds no lease
                assert refused_streams(cfg, "peer_limit") == 1
                held.pop().close()
                poll(lambda: in_flight(cfg) == 2, "one stream closed")
                again = HeldStream(ch)  # below the cap again: admitted
                held.append(again)
                assert again.first() == "request_headers" and in_flight(cfg) == 3
            finally:
                for h in held:
                    h.close()
        poll(lambda: in_flight(cfg) == 0, "every lease released")
    finally:
        assert picker.stop() == 0
    stopped = re.search(r"event=picker_stopped .*peer_limit=(\d+)", picker.stderr())
    assert stopped is not None and stopped.group(1) == "1"


# -- the chart's defaults through the real Envoy ------------------------------------------------------------------


def secret_value(objs: list[dict[str, Any]], name: str, key: str) -> str:
    return base64.b64decode(cv.find(objs, "Secret", name)["data"][key]).decode()


def ext_proc_service(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (listener,) = [x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "inference_listener"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    service: dict[str, Any] = ext_proc["typed_config"]["grpc_service"]
    return service


def run_envoy(bootstrap: dict[str, Any], workdir: Path, name: str) -> tuple[ManagedProcess, str]:
    """The real Envoy on ``bootstrap`` with its own ports moved to free ones; the process and its chat URL."""
    cfg = copy.deepcopy(bootstrap)
    admin_port, listen, stats = free_port(), free_port(), free_port()
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    for x in cfg["static_resources"]["listeners"]:
        x["address"]["socket_address"]["port_value"] = listen if x["name"] == "inference_listener" else stats
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == "envoy_admin":  # what the stats listener proxies
            lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            lb["endpoint"]["address"]["socket_address"]["port_value"] = admin_port
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"]
    mp = spawn_ready(name, argv, workdir, f"http://127.0.0.1:{admin_port}/ready")
    return mp, f"http://127.0.0.1:{listen}/v1/chat/completions"


@pytest.mark.envoy
def test_with_the_charts_defaults_envoy_reaches_a_picker_bound_beyond_loopback(workdir: Path) -> None:
    """The chart rendered with its defaults (sidecar Envoy, self-signed TLS, extprocAuth.mode token), the picker's
    ports moved to free ones: the picker runs with the chart's extproc section (bindAddress 0.0.0.0, the token file,
    TLS), the token being its Secret's; Envoy runs the chart's bootstrap (from its Secret) with its own ports moved
    and one change: the pool's endpoints are 127.0.0.1 instead of the headless Service, which does not resolve
    here. A request is routed by the picker and served. The same bootstrap without the token's metadata (an Envoy
    the chart did not configure) is refused by the picker: 500, no lease, counted."""
    backends = start_backends(2, workdir)
    ports = {k: free_port() for k in ("extproc", "health", "admin")}
    values = cv.merge(
        cv.REQUIRED,
        {"picker": {"ports": ports}, "inferencePool": {"targetPorts": [{"number": p} for p in backends.ports]}},
    )
    objs = cv.objects(values)
    token = secret_value(objs, "kv-epp-extproc-token", "token")
    bootstrap = json.loads(secret_value(objs, "kv-epp-envoy", "envoy.json"))
    extproc = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])["extproc"]
    assert extproc["host"] == "0.0.0.0" and extproc["auth"] == {"token_file": "/etc/kv-epp/extproc-auth/token"}
    (workdir / "chart-token").write_text(token)
    extproc["auth"]["token_file"] = str(workdir / "chart-token")  # the Secret's key, mounted here
    extproc["drain_propagation_seconds"] = 0.5  # the sidecar's drain timing is not under test
    cfg = {"pool": {"backends": backends.pool()}, "extproc": extproc, "admin": {"port": ports["admin"]}}
    picker, _ = serve(cfg, workdir, "chart-picker")
    envoys: list[ManagedProcess] = []
    try:
        for cluster in bootstrap["static_resources"]["clusters"]:
            if cluster["name"] == "inference_pool":
                for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
                    e["endpoint"]["address"]["socket_address"]["address"] = "127.0.0.1"
        assert ext_proc_service(bootstrap)["initial_metadata"] == [{"key": "authorization", "value": f"Bearer {token}"}]
        body = {"model": "m", "messages": [{"role": "user", "content": "through the chart's Envoy"}]}

        envoy, url = run_envoy(bootstrap, workdir, "chart-envoy")
        envoys.append(envoy)
        served = poll(lambda: (r := http("POST", url, body)).status == 200 and r, "a request served through Envoy")
        assert served.headers["x-backend"] in backends.names
        assert admin(cfg, "/readyz")["extproc"]["client_auth"] == ["token"]
        poll(lambda: in_flight(cfg) == 0, "the served request's lease released")

        anonymous = copy.deepcopy(bootstrap)
        del ext_proc_service(anonymous)["initial_metadata"]
        envoy, url = run_envoy(anonymous, workdir, "chart-envoy-no-token")
        envoys.append(envoy)
        before = refused_streams(cfg, "unauthenticated")

        def refused() -> bool:
            status = http("POST", url, body).status
            return status == 500 and refused_streams(cfg, "unauthenticated") > before

        poll(refused, "Envoy without the token refused by the picker")
        assert http("POST", url, body).status == 500 and in_flight(cfg) == 0
        assert token not in picker.stderr()
    finally:
        for e in envoys:
            e.stop()
        assert picker.stop() == 0
        backends.process.stop()
