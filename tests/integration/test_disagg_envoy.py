"""P/D disaggregation's wire through a real Envoy, in both request body modes (docs/pd.md): a long prompt's request
reaches its decode endpoint with ``x-prefiller-host-port`` naming the prefill endpoint, a short one's without it,
and a client's own copy of the header never reaches an upstream. Echo backends stand in for the decode pods'
sidecars (they report the header they received); the decisions are counted under llm-d's name and ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.stack import free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http, start_backends

pytestmark = pytest.mark.integration
OUTSIDE = "6.6.6.6:1"  # a client's choice of prefill target: never forwarded


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_prefill_header_is_the_pickers_alone(tmp_path: Path, body_mode: str) -> None:
    backends = start_backends(3, tmp_path)
    pool = [
        {"name": "be-0", "address": backends.address(0), "role": "decode"},
        {"name": "be-1", "address": backends.address(1), "role": "decode"},
        {"name": "be-2", "address": backends.address(2), "role": "prefill"},
    ]
    config = {
        "selection_strategy": "LeastRequest",
        "pool": {"backends": pool},
        "disaggregation": {"enabled": True, "min_uncached_tokens": 500},  # ~2,000 bytes of body (not tokenized)
    }
    picker = start_picker(config, tmp_path, name=f"pd-{body_mode}")
    envoy = None
    try:
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), body_mode=body_mode,
            picker_address=f"127.0.0.1:{picker.extproc_port}", picker_tls=picker.tls,
            backends=tuple(b["address"] for b in pool),
        )  # fmt: skip
        envoy = start_envoy(opts, tmp_path)
        url = envoy.url + "/v1/chat/completions"
        for stream in (False, True):
            long = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x" * 4000}]}
            r = http("POST", url, long, {"x-prefiller-host-port": OUTSIDE})
            assert r.status == 200, r.body
            assert r.headers["x-backend"] in ("be-0", "be-1")  # the prefill endpoint takes no whole request
            assert r.headers["x-seen-prefiller"] == backends.address(2)
            short = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
            r = http("POST", url, short, {"x-prefiller-host-port": OUTSIDE})
            assert r.status == 200, r.body
            assert r.headers["x-backend"] in ("be-0", "be-1") and r.headers["x-seen-prefiller"] == "<absent>"
        assert backends.stats(2)["seen"] == 0  # nothing was sent to the prefill endpoint as a whole request
        text = http("GET", f"http://127.0.0.1:{picker.admin_port}/metrics").body.decode()
        ours = "continuum_picker_disagg_decisions_total"
        assert sample(text, ours, decision_type="prefill-decode", reason="cost") == 2
        assert sample(text, ours, decision_type="decode-only", reason="below_threshold") == 2
        llmd = "llm_d_epp_disagg_decision_total"
        assert sample(text, llmd, decision_type="prefill-decode", model_name="m") == 2
        assert sample(text, llmd, decision_type="decode-only", model_name="m") == 2
        pool_report = http("GET", f"http://127.0.0.1:{picker.admin_port}/admin/pool").json()
        assert pool_report["disaggregation"]["roles"] == {"prefill": 1, "decode": 2, "both": 0}
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()
        backends.process.stop()
