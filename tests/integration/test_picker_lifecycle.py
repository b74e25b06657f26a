"""The `kv-epp` process: gRPC health, hot reload, the drain order, supervised background tasks, the
ready line, one-line startup errors, and bootstraps Envoy accepts."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.stack import envoy_binary, free_port, start_envoy, start_picker
from picker.config import parse_settings
from picker.runtime.compose import build_app
from picker.runtime.envoy_config import EnvoyOptions
from picker.runtime.lifecycle import PickerServer
from tests.integration.conftest import http, start_backends
from tests.support.ready_process import CliProcess, poll, run_cli, start_cli, write_yaml

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BACKEND = {"name": "be-0", "address": "127.0.0.1:9"}  # never contacted: the picker only names it
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def health_status(port: int, service: str, tls: bool = False) -> int:
    """gRPC health on ``port``; ``tls``: over TLS, trusting the certificate the port shows (the ext_proc
    port speaks TLS by default; the separate health port is plaintext)."""
    if tls:
        roots = ssl.get_server_certificate(("127.0.0.1", port), timeout=10).encode()
        ch = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(roots))
    else:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    with ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def picker_config(**sections: Any) -> dict[str, Any]:
    """A valid config (one backend: no config warnings on stderr) with free ports unless given."""
    extproc = {"host": "127.0.0.1", "port": free_port(), "health_port": free_port(), **sections.pop("extproc", {})}
    admin = {"port": free_port(), **sections.pop("admin", {})}
    return {"pool": {"backends": [BACKEND]}, "extproc": extproc, "admin": admin, **sections}


def serve(cfg: dict[str, Any], workdir: Path, name: str) -> CliProcess:
    path = write_yaml(workdir / f"{name}.yaml", cfg)
    return start_cli(["-m", "picker", "serve", "--config", str(path)], workdir, name)


def headers_msg(path: str, method: str = "POST", eos: bool = False, status: str | None = None) -> pb.HttpHeaders:
    pairs = [(":status", status)] if status else [(":path", path), (":method", method)]
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=eos)


def test_grpc_health_services(workdir: Path) -> None:
    health_port = free_port()
    picker = start_picker({"extproc": {"health_port": health_port}}, workdir, name="picker-health")
    try:
        for port, tls in ((picker.extproc_port, True), (health_port, False)):
            for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension"):
                assert health_status(port, svc, tls) == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert picker.stop() == 0


def applied_reloads(admin_url: str) -> float:
    text = http("GET", admin_url + "/metrics").body.decode()
    m = re.search(r'^continuum_picker_config_reloads_total\{result="applied"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_hot_reload_applies_hot_sections_and_rejects_bad_files(workdir: Path) -> None:
    picker = start_picker({"prefix_routing": {"enabled": True, "virtual_nodes": 150}}, workdir, name="picker-reload")
    try:
        cfg = dict(picker.config)
        cfg["prefix_routing"] = {"enabled": True, "virtual_nodes": 40}
        picker.config_path.write_text(yaml.safe_dump(cfg))
        deadline = time.monotonic() + 10
        while http("GET", picker.admin_url + "/admin/prefix-routing/stats").json()["config"]["virtual_nodes"] != 40:
            assert time.monotonic() < deadline, "file change was not picked up"
            time.sleep(0.1)
        picker.config_path.write_text("prefix_routing:\n  virtual_nodes: -5\n")
        r = http("POST", picker.admin_url + "/admin/config/reload")
        assert r.status == 400 and "prefix_routing.virtual_nodes" in r.json()["messages"][0]
        assert http("GET", picker.admin_url + "/admin/prefix-routing/stats").json()["config"]["virtual_nodes"] == 40
        cfg["extproc"] = {**cfg["extproc"], "max_body_bytes": 4096}
        cfg["prefix_routing"] = {"enabled": True, "virtual_nodes": 60}
        picker.config_path.write_text(yaml.safe_dump(cfg))
        r = http("POST", picker.admin_url + "/admin/config/reload")
        assert r.status == 200 and any("extproc" in m and "restart required" in m for m in r.json()["messages"])
        before = applied_reloads(picker.admin_url)
        picker.process.proc.send_signal(signal.SIGHUP)  # SIGHUP reloads too, and must not kill the process
        poll(lambda: applied_reloads(picker.admin_url) > before, "the SIGHUP reload")
        assert picker.process.proc.poll() is None
    finally:
        picker.stop()


@pytest.mark.envoy
def test_sigterm_drains_open_requests(workdir: Path) -> None:
    backends = start_backends(1, workdir)
    picker = start_picker(
        {"pool": {"backends": backends.pool()}, "extproc": {"drain_seconds": 10}},
        workdir,
        name="picker-drain",
    )
    envoy = start_envoy(
        EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                     picker_address=f"127.0.0.1:{picker.extproc_port}",
                     backends=tuple(b["address"] for b in backends.pool())),
        workdir,
    )  # fmt: skip
    try:
        backends.control(0, delay_ms=1500)
        result: dict[str, object] = {}

        def slow_request() -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "slow"}],
                "stream": True,
                "max_tokens": 3,
            }
            result["r"] = http("POST", envoy.url + "/v1/chat/completions", body)

        t = threading.Thread(target=slow_request)
        t.start()
        deadline = time.monotonic() + 10
        while not http("GET", picker.admin_url + "/admin/prefix-routing/stats").json()["backend_distribution"][0][
            "in_flight_requests"
        ]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        picker.process.proc.send_signal(signal.SIGTERM)
        poll(lambda: http("GET", picker.admin_url + "/readyz").status == 503, "not ready while draining")
        t.join(timeout=20)
        r = result["r"]
        assert r.status == 200 and b"[DONE]" in r.body  # type: ignore[attr-defined]
        assert picker.process.proc.wait(timeout=15) == 0
    finally:
        envoy.stop()
        picker.stop()
        backends.process.stop()


@pytest.mark.envoy
@pytest.mark.parametrize(
    "args",
    [
        ["--backend", "10.0.0.1:8000"],
        ["--body-mode", "BUFFERED", "--fail-open", "--backend", "10.0.0.1:8000", "--backend", "10.0.0.2:8000"],
        ["--mode", "standalone", "--picker", "kv-epp.default.svc:9002", "--backend", "10.0.0.1:8000"],
        ["--mode", "no-picker", "--backend", "10.0.0.1:8000", "--backend", "10.0.0.2:8000"],
    ],
)
def test_envoy_config_is_accepted_by_envoy(args: list[str], tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "picker", "envoy-config", *args], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(out.stdout)
    v = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert v.returncode == 0, v.stdout + v.stderr
    assert json.dumps(yaml.safe_load(out.stdout))  # plain data, no YAML tags


def test_envoy_config_standalone_needs_picker() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "picker", "envoy-config", "--mode", "standalone"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--picker" in out.stderr


# -- the supervised lifecycle (issue 7) ------------------------------------------------------------


def test_ready_line_names_the_bound_ports(workdir: Path) -> None:
    cfg = picker_config()
    ext, hp, ap = cfg["extproc"]["port"], cfg["extproc"]["health_port"], cfg["admin"]["port"]
    picker = serve(cfg, workdir, "picker-ready")
    try:
        line = picker.read_line()
        assert line == f"kv-epp ready extproc=127.0.0.1:{ext} health=127.0.0.1:{hp} admin=127.0.0.1:{ap} tls=on"
        # printed once everything listens: each port answers at once, no retry needed
        assert health_status(ext, "readiness", tls=True) == SERVING and health_status(hp, "readiness") == SERVING
        assert http("GET", f"http://127.0.0.1:{ap}/readyz").status == 200
        assert "kv-epp ready" not in picker.stderr()  # stdout only; logs stay on stderr
    finally:
        assert picker.stop() == 0


def test_ready_line_reports_ports_chosen_by_the_system(workdir: Path) -> None:
    cfg = picker_config(extproc={"port": 0, "health_port": None, "tls": {"mode": "plaintext"}}, admin={"port": 0})
    picker = serve(cfg, workdir, "picker-p0")
    try:
        m = re.fullmatch(
            r"kv-epp ready extproc=127\.0\.0\.1:(\d+) health=127\.0\.0\.1:(\d+) admin=(\S+) tls=off",
            picker.read_line(),
        )
        assert m is not None and m.group(1) == m.group(2) and int(m.group(1)) > 0
        assert health_status(int(m.group(1)), "readiness") == SERVING
        assert http("GET", f"http://{m.group(3)}/readyz").status == 200
    finally:
        assert picker.stop() == 0


@pytest.mark.parametrize("which", ["ext_proc", "health", "admin"])
def test_port_in_use_is_one_error_line_and_exit_2(which: str, busy_port: int, workdir: Path) -> None:
    extproc = {"port": busy_port} if which == "ext_proc" else {"health_port": busy_port} if which == "health" else {}
    admin = {"port": busy_port} if which == "admin" else {}
    path = write_yaml(workdir / f"busy-{which}.yaml", picker_config(extproc=extproc, admin=admin))
    out = run_cli(["-m", "picker", "serve", "--config", str(path)])
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""  # no ready line
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr  # no traceback, no "coroutine was never awaited", no gRPC core log
    assert lines[0].startswith(f"error: {which} port 127.0.0.1:{busy_port}: ") and "in use" in lines[0]


@pytest.mark.parametrize("kind", ["missing", "not_yaml", "two_bad_values"])
def test_bad_config_file_is_one_error_line_and_exit_2(kind: str, workdir: Path) -> None:
    path = workdir / f"bad-{kind}.yaml"
    if kind == "not_yaml":
        path.write_text("extproc: {port: [\n")
    elif kind == "two_bad_values":
        write_yaml(path, {"extproc": {"port": -1, "drain_propagation_seconds": 1000}})
    out = run_cli(["-m", "picker", "serve", "--config", str(path)])
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    if kind == "two_bad_values":
        assert "extproc.port" in lines[0] and "extproc.drain_propagation_seconds" in lines[0]


def test_drain_refuses_new_streams_while_an_open_one_finishes(workdir: Path) -> None:
    """SIGTERM: readiness NOT_SERVING, then new streams get UNAVAILABLE while an open stream still
    completes its response phases; the process exits 0 once it has."""
    cfg = picker_config(
        extproc={"drain_propagation_seconds": 0.2, "drain_seconds": 120, "tls": {"mode": "plaintext"}}
    )  # a plaintext client: plaintext configured
    picker = serve(cfg, workdir, "picker-drain-order")
    channel = None
    try:
        picker.read_line()
        channel = grpc.insecure_channel(f"127.0.0.1:{cfg['extproc']['port']}")
        stub = pb_grpc.ExternalProcessorStub(channel)
        # stream A: routed before the drain, still waiting for its response phases
        requests: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        a = stub.Process(iter(requests.get, None), timeout=120)
        requests.put(pb.ProcessingRequest(request_headers=headers_msg("/v1/chat/completions")))
        requests.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True)))
        assert next(a).WhichOneof("response") != "immediate_response"

        picker.signal(signal.SIGTERM)
        poll(lambda: health_status(cfg["extproc"]["health_port"], "readiness") == NOT_SERVING, "readiness NOT_SERVING")
        assert health_status(cfg["extproc"]["health_port"], "liveness") == SERVING

        def new_stream_refused() -> str | None:
            b = stub.Process(iter([pb.ProcessingRequest(request_headers=headers_msg("/v1/models", "GET", eos=True))]))
            try:
                for _ in b:
                    pass
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return str(exc.details())
            return None  # still admitted: the propagation delay has not passed yet

        assert "draining" in poll(new_stream_refused, "a new stream to be refused")
        assert picker.proc.poll() is None  # still draining: stream A is open
        metrics_url = f"http://127.0.0.1:{cfg['admin']['port']}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            refused = re.search(r'continuum_picker_requests_total\{outcome="draining"\} (\S+)', r.read().decode())
        assert refused is not None and float(refused.group(1)) >= 1  # the refusal is counted, not only logged

        requests.put(pb.ProcessingRequest(response_headers=headers_msg("", eos=True, status="200")))
        requests.put(None)
        assert [r.WhichOneof("response") for r in a][-1] == "response_headers"  # A completed normally
        assert picker.proc.wait(timeout=60) == 0
        stopped = re.search(r"event=picker_stopped refused_streams=(\d+)", picker.stderr())
        assert stopped is not None and int(stopped.group(1)) >= 1
    finally:
        if channel is not None:
            channel.close()
        picker.stop()


async def test_crashed_background_task_flips_readiness_and_is_counted() -> None:
    """A background task that raises: gRPC readiness NOT_SERVING (liveness stays SERVING), /readyz 503
    naming the task, the failure counted; the process keeps serving and stops cleanly."""
    settings = parse_settings(picker_config(extproc={"health_port": None, "tls": {"mode": "plaintext"}}))
    server = PickerServer(build_app(settings))
    release = asyncio.Event()

    async def exploding_task() -> None:
        await release.wait()
        raise RuntimeError("disk on fire")

    server.background.append(exploding_task)
    await server.start()
    admin = f"http://127.0.0.1:{server.admin_port}"
    try:
        async with (
            aiohttp.ClientSession() as session,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.extproc_port}") as ch,
        ):
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(svc: str) -> int:
                return int((await stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)).status)

            assert await status("readiness") == SERVING
            release.set()
            async with asyncio.timeout(30):
                while await status("readiness") != NOT_SERVING:
                    await asyncio.sleep(0.02)
            assert await status("liveness") == SERVING
            # what Envoy health-checks stays SERVING: the picker still routes, Envoy keeps sending it streams
            assert await status("kv-epp.accepting") == SERVING
            async with session.get(admin + "/readyz") as r:
                body = await r.json()
                assert r.status == 503 and "exploding_task" in body["reason"] and "disk on fire" in body["reason"]
            async with session.get(admin + "/metrics") as r:
                text = await r.text()
            assert 'continuum_picker_background_task_failures_total{task="exploding_task"} 1.0' in text
    finally:
        await server.stop()
