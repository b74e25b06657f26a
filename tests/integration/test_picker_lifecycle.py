"""The `kv-epp` process: gRPC health, hot reload, SIGTERM drain, and bootstraps Envoy accepts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.stack import envoy_binary, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http, start_backends

pytestmark = pytest.mark.envoy


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_grpc_health_services(workdir: Path) -> None:
    health_port = free_port()
    picker = start_picker({"extproc": {"health_port": health_port}}, workdir, name="picker-health")
    try:
        for port in (picker.extproc_port, health_port):
            for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert health_status(port, svc) == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert picker.stop() == 0


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
        picker.process.proc.send_signal(signal.SIGHUP)  # SIGHUP reloads too, and must not kill the process
        time.sleep(0.3)
        assert picker.process.proc.poll() is None
    finally:
        picker.stop()


def test_sigterm_drains_open_requests(workdir: Path) -> None:
    backends = start_backends(1, workdir)
    picker = start_picker(
        {"pool": {"backends": backends.pool()}, "extproc": {"drain_seconds": 10}},
        workdir,
        name="picker-drain",
    )
    envoy = start_envoy(
        EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                     picker_address=f"127.0.0.1:{picker.extproc_port}"),
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
        time.sleep(0.2)
        assert http("GET", picker.admin_url + "/readyz").status == 503  # not ready while draining
        t.join(timeout=20)
        r = result["r"]
        assert r.status == 200 and b"[DONE]" in r.body  # type: ignore[attr-defined]
        assert picker.process.proc.wait(timeout=15) == 0
    finally:
        envoy.stop()
        picker.stop()
        backends.process.stop()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--body-mode", "BUFFERED", "--fail-open"],
        ["--mode", "standalone", "--picker", "kv-epp.default.svc:9002"],
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
