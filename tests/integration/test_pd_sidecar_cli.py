"""``kv-epp pd-sidecar`` as a process: it refuses to start without an allowlist of prefill targets (one ``error:``
line, exit 2), and otherwise prints its ready line, runs a P/D request between two engine stand-ins, serves its own
counters on ``--metrics-port`` and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support.pd_engines import closed_port, fake_engine

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HEADER = "x-prefiller-host-port"


def run(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "picker", "pd-sidecar", *flags], capture_output=True, text=True, timeout=60, env=ENV
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ((), "no allowlist of prefill targets"),
        (("--prefill-targets", "10.0.0.1:8000", "--backends-file", "b.yaml"), "give one allowlist source"),
        (("--prefill-targets", "prefill-0:8000"), "is not an IP address"),
        (("--prefill-targets", "::1:8000"), "must be in brackets"),
        (("--inference-pool", "llm/Not_A_Name"), "--inference-pool"),
        (("--ssrf-protection", "off", "--prefill-targets", "10.0.0.1:8000"), "would not be used"),
        (("--backends-file", "/nonexistent/backends.yaml"), "cannot read the file"),
    ],
)
def test_it_refuses_to_start_without_a_usable_allowlist(flags: tuple[str, ...], said: str) -> None:
    done = run("--port", "0", *flags)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert done.stdout == ""


async def test_the_process_serves_pd_and_its_counters_and_drains_on_sigterm() -> None:
    async with fake_engine() as decode, fake_engine() as prefill:

        async def prefill_answer(*_: object) -> aiohttp.web.StreamResponse:
            return aiohttp.web.json_response({"kv_transfer_params": {"remote_engine_id": "p"}})

        prefill.answer = prefill_answer
        metrics_port = closed_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "picker", "pd-sidecar", "--host", "127.0.0.1", "--port", "0",
            "--model-server-port", str(decode.port), "--prefill-targets", prefill.address,
            "--metrics-port", str(metrics_port),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            ready = re.match(r"kv-epp pd-sidecar ready port=127\.0\.0\.1:(\d+) engine=(\S+) connector=nixlv2 "
                             r"allowlist=static\(1\) metrics=127\.0\.0\.1:(\d+)$", line.strip())  # fmt: skip
            assert ready, line
            assert ready[2] == f"http://127.0.0.1:{decode.port}" and int(ready[3]) == metrics_port
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{ready[1]}/v1/chat/completions"
                body = {"model": "m", "prompt": "p"}
                async with client.post(url, json=body, headers={HEADER: prefill.address}) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kv-epp-prefill"] == "remote"
                async with client.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                    text = await resp.text()
            assert 'kv_pd_sidecar_pd_requests_total{connector="nixlv2"} 1.0' in text
            assert "kv_pd_sidecar_allowlist_targets 1.0" in text
            assert json.loads(decode.seen[0].body) == {**body, "kv_transfer_params": {"remote_engine_id": "p"}}
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
