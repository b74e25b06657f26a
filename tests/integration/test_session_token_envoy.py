"""llm-d's stateless affinity through real Envoys: a conversation that sends back the ``x-session-token`` of each
response stays on one endpoint although its turns alternate between two pickers (each behind its own Envoy, no
shared state, RoundRobin), in Envoy's default response mode (``none``: the picker still sees the response headers).
Without the token the same turns spread over both endpoints."""

from __future__ import annotations

import base64
from pathlib import Path

from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http, start_backends


def envoy_for(picker: PickerProcess, addresses: tuple[str, ...], workdir: Path) -> EnvoyProcess:
    opts = EnvoyOptions(
        listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
        picker_address=f"127.0.0.1:{picker.extproc_port}", picker_tls=picker.tls, backends=addresses,
    )  # fmt: skip
    return start_envoy(opts, workdir)


def conversation(urls: list[str], with_token: bool) -> list[str]:
    """Six turns, alternating between the Envoys; the backend that answered each."""
    served: list[str] = []
    token: str | None = None
    messages = [{"role": "user", "content": "hello"}]
    for turn in range(6):
        headers = {"x-session-token": token} if token is not None and with_token else {}
        r = http("POST", urls[turn % 2] + "/v1/chat/completions", {"model": "m", "messages": messages}, headers)
        assert r.status == 200, r.body
        backend = r.headers["x-backend"]
        assert r.headers["x-session-token"] == base64.b64encode(backend.encode()).decode()  # a static pool: the name
        token = r.headers["x-session-token"]
        served.append(backend)
        messages = [*messages, {"role": "assistant", "content": backend}, {"role": "user", "content": f"turn {turn}"}]
    return served


def test_a_conversation_keeps_its_endpoint_across_two_pickers_by_its_token(tmp_path: Path) -> None:
    backends = start_backends(2, tmp_path)
    pool = backends.pool()
    addresses = tuple(b["address"] for b in pool)
    pickers: list[PickerProcess] = []
    envoys: list[EnvoyProcess] = []
    try:
        for i in range(2):
            pickers.append(
                start_picker({"selection_strategy": "RoundRobin", "pool": {"backends": pool}}, tmp_path, name=f"t{i}")
            )
            envoys.append(envoy_for(pickers[i], addresses, tmp_path))
        urls = [e.url for e in envoys]
        with_token = conversation(urls, with_token=True)
        without = conversation(urls, with_token=False)
    finally:
        for e in envoys:
            e.stop()
        for p in pickers:
            p.stop()
        backends.process.stop()
    assert len(set(with_token)) == 1, with_token
    assert set(without) == {"be-0", "be-1"}, without  # RoundRobin alone spreads the turns
