"""A 90/10 model rewrite (the config's ``model_rewrites``) through the real Envoy and the picker, full duplex and
BUFFERED: an upstream that records the bodies it receives shows every request arriving with a target model, its
body byte-identical to what the client sent but for the model's value (and a ``content-length`` that matches it,
when one is sent), and the canary receiving 10% ± 3% of 1,000 requests (the draw is per request, from a random
start on a low-discrepancy sequence: within a few requests of 100 on every run). A model no rule matches arrives
byte-identical; after a hot reload that drops the rule, so does the rewritten one. The same on the request path
alone, with Tier 4's keys: tests/unit/picker/request/test_model_rewrite.py."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.recording_upstream import RecordingUpstream

pytestmark = pytest.mark.envoy

CANARY = {
    "name": "canary",
    "rules": [
        {
            "matches": [{"model": {"type": "Exact", "value": "chat-model"}}],
            "targets": [
                {"modelRewrite": "chat-model-v1", "weight": 90},
                {"modelRewrite": "chat-model-v2", "weight": 10},
            ],
        }
    ],
}


class Stack:
    def __init__(self, upstream: RecordingUpstream, picker: PickerProcess, envoy: EnvoyProcess) -> None:
        self.upstream, self.picker, self.envoy = upstream, picker, envoy

    def send(self, raw: bytes, path: str = "/v1/completions") -> bytes:
        """POST ``raw`` through Envoy; the body the upstream received."""
        before = len(self.upstream.seen)
        r = http("POST", self.envoy.url + path, raw)
        assert r.status == 200, (r.status, r.body[:300])
        assert len(self.upstream.seen) == before + 1
        body, framing = self.upstream.seen[-1]
        if "content-length" in framing:  # what Envoy forwards must frame exactly the body it sends
            assert int(framing["content-length"]) == len(body), framing
        return body

    def set_rewrites(self, rewrites: list[dict[str, object]]) -> None:
        cfg = yaml.safe_load(self.picker.config_path.read_text())
        cfg["model_rewrites"] = rewrites
        self.picker.config_path.write_text(yaml.safe_dump(cfg))
        r = http("POST", self.picker.admin_url + "/admin/config/reload", {})
        assert r.status == 200, r.body


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp(f"rewrite-{request.param}")
    with RecordingUpstream() as upstream:
        picker = envoy = None
        try:
            cfg = {"pool": {"backends": [{"name": "up", "address": upstream.address}]}, "model_rewrites": [CANARY]}
            picker = start_picker(cfg, workdir, name="picker-rewrite")
            opts = EnvoyOptions(
                listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                body_mode=request.param, backends=(upstream.address,), **picker.envoy_picker_options(),
            )  # fmt: skip
            envoy = start_envoy(opts, workdir)
            yield Stack(upstream, picker, envoy)
        finally:
            if envoy is not None:
                envoy.stop()
            if picker is not None:
                picker.stop()


def client_body(model: str, i: int) -> bytes:
    """A client's body as SDKs write it (json.dumps' spaces: a re-serialization would show)."""
    return json.dumps({"model": model, "prompt": f"request {i}: " + "lorem " * 40, "max_tokens": 8}).encode()


def test_a_90_10_rewrite_reaches_the_upstream_with_the_target_model_in_proportion(stack: Stack) -> None:
    stack.set_rewrites([CANARY])
    served: Counter[str] = Counter()
    for i in range(1000):
        sent = client_body("chat-model", i)
        got = stack.send(sent)
        model = json.loads(got)["model"]
        assert model in ("chat-model-v1", "chat-model-v2")
        assert got == sent.replace(b'"chat-model"', json.dumps(model).encode())  # only the model's value changed
        served[model] += 1
    assert 70 <= served["chat-model-v2"] <= 130, served
    metrics = http("GET", stack.picker.admin_url + "/metrics").body.decode()
    line = (
        'llm_d_epp_model_rewrite_decisions_total{model_name="chat-model",model_rewrite_name="canary",'
        'target_model="chat-model-v2"} '
    )
    assert f"{line}{float(served['chat-model-v2'])}" in metrics


def test_an_unmatched_model_and_a_dropped_rule_leave_the_body_as_sent(stack: Stack) -> None:
    stack.set_rewrites([CANARY])
    sent = client_body("other-model", 0)
    assert stack.send(sent) == sent
    stack.set_rewrites([])
    sent = client_body("chat-model", 1)
    assert stack.send(sent) == sent
    stack.set_rewrites([CANARY])
