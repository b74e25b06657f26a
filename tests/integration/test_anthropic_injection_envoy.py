"""Anthropic ``cache_control`` injection through the real Envoy, full duplex and BUFFERED: an upstream that
records the bodies it receives shows that a native Anthropic request without markers arrives with exactly one
``{"type": "ephemeral"}`` marker on its last system block (and a ``content-length`` that matches, when one is
sent); a request that carries markers arrives byte-identical to what the client sent; with the flag turned off
by a hot reload, a request without markers arrives byte-identical too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.request.anthropic import count_markers
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.recording_upstream import RecordingUpstream

pytestmark = pytest.mark.envoy

EPHEMERAL = {"type": "ephemeral"}


class Stack:
    def __init__(self, upstream: RecordingUpstream, picker: PickerProcess, envoy: EnvoyProcess) -> None:
        self.upstream, self.picker, self.envoy = upstream, picker, envoy

    def send(self, raw: bytes, path: str = "/v1/messages") -> bytes:
        """POST ``raw`` through Envoy; the body the upstream received."""
        before = len(self.upstream.seen)
        headers = {"anthropic-version": "2023-06-01"}
        r = http("POST", self.envoy.url + path, raw, headers)
        assert r.status == 200, (r.status, r.body[:300])
        assert len(self.upstream.seen) == before + 1
        body, framing = self.upstream.seen[-1]
        if "content-length" in framing:  # what Envoy forwards must frame exactly the body it sends
            assert int(framing["content-length"]) == len(body), framing
        return body

    def set_injection(self, on: bool) -> None:
        cfg = yaml.safe_load(self.picker.config_path.read_text())
        cfg["prefix_routing"]["anthropic_cache_control_injection"] = on
        self.picker.config_path.write_text(yaml.safe_dump(cfg))
        r = http("POST", self.picker.admin_url + "/admin/config/reload", {})
        assert r.status == 200, r.body


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp(f"anthropic-{request.param}")
    with RecordingUpstream() as upstream:
        picker = envoy = None
        try:
            cfg = {
                "pool": {"backends": [{"name": "up", "address": upstream.address}]},
                "prefix_routing": {"anthropic_cache_control_injection": True},
            }
            picker = start_picker(cfg, workdir, name="picker-anthropic")
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


def client_body(system: Any) -> bytes:
    """A client's body as SDKs write it (json.dumps' spaces: a re-serialization would show)."""
    data = {
        "model": "claude-x", "max_tokens": 32, "system": system,
        "messages": [{"role": "user", "content": "Summarise the docs."}],
    }  # fmt: skip
    return json.dumps(data).encode()


def test_request_without_markers_gains_one_on_its_last_system_block(stack: Stack) -> None:
    stack.set_injection(True)
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Docs: " + "lorem " * 500}]
    sent = client_body(system)
    got = stack.send(sent)
    assert count_markers(got) == 1
    upstream = json.loads(got)
    assert upstream["system"][-1]["cache_control"] == EPHEMERAL and "cache_control" not in upstream["system"][0]
    original = json.loads(sent)
    del upstream["system"][-1]["cache_control"]
    assert upstream == original  # nothing else changed
    as_string = stack.send(client_body("You are terse."))  # a string system prompt becomes one marked block
    assert json.loads(as_string)["system"] == [{"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}]


def test_request_with_markers_is_byte_identical(stack: Stack) -> None:
    stack.set_injection(True)
    sent = client_body(
        [{"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}, {"type": "text", "text": "x"}]
    )
    assert stack.send(sent) == sent


def test_other_apis_are_untouched(stack: Stack) -> None:
    stack.set_injection(True)
    sent = json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]}
    )
    assert stack.send(sent.encode(), "/v1/chat/completions") == sent.encode()


def test_flag_off_by_hot_reload_is_byte_identical(stack: Stack) -> None:
    stack.set_injection(False)
    try:
        sent = client_body("You are terse.")
        assert stack.send(sent) == sent
    finally:
        stack.set_injection(True)
