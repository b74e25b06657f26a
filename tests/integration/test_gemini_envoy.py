"""``type: gemini`` backends through the real Envoy, against the FAKE Generative Language API
(``tests/support/fake_gemini.py``, a subprocess; not Google's service): a request for a gemini model goes to the
external cluster with the API key; the seed's context cache creates one ``cachedContents`` resource for a long
system prompt (single-flight under 10 concurrent first requests) and later requests reference it without the
duplicated system text, with the cached input tokens in the OpenAI usage; a short prompt creates nothing; a
refused creation is not retried; the admin stats and clear endpoints answer the seed's JSON; with the cache off,
no cache work; the engines' models route as before. Both body modes for the native API, full duplex for the rest;
and one stack where Envoy reaches the fake over TLS with SNI and a verified certificate for ``localhost``."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, spawn_ready_line, start_envoy, start_picker
from picker.config import parse_settings
from picker.runtime.envoy_config import EnvoyOptions
from picker.runtime.envoy_needs import Given, derive
from tests.integration.conftest import Backends, HttpResult, http, start_backends
from tests.support.certs import TestCA, write_pair

pytestmark = pytest.mark.envoy

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-" + "x" * 30
MODEL = "gemini-2.5-flash"
SYSTEM_20K = "You are a careful assistant. " * 720  # about 20 KB


@dataclass
class Fake:
    base_url: str
    process: Any

    def stats(self) -> Any:
        return http("GET", f"{self.base_url}/_fake/stats").json()

    def control(self, **kw: Any) -> None:
        http("POST", f"{self.base_url}/_fake/control", kw)


def start_fake(workdir: Path, key_file: Path, tls: tuple[Path, Path] | None = None, host: str = "127.0.0.1") -> Fake:
    argv = [sys.executable, "-m", "tests.support.fake_gemini", "--port", "0", "--api-key-file", str(key_file),
            "--min-cache-tokens", "1024", "--host", host]  # fmt: skip
    if tls is not None:
        argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    name = f"fake-gemini-{uuid.uuid4().hex[:6]}"
    proc, line = spawn_ready_line(name, argv, workdir, "READY", env={"PYTHONPATH": str(ROOT)})
    port = int(line.split()[1])
    scheme = "https" if tls is not None else "http"
    return Fake(f"{scheme}://{'localhost' if tls is not None else host}:{port}", proc)


@dataclass
class Stack:
    backends: Backends
    picker: PickerProcess
    envoy: EnvoyProcess
    fake: Fake

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.opts.listen_port}"

    def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> HttpResult:
        return http("POST", self.url + "/v1/chat/completions", body, headers)

    def cache_stats(self) -> Any:
        return http("GET", self.picker.admin_url + "/admin/gemini-context-cache/stats").json()


@pytest.fixture(scope="module")
def key_file(workdir: Path) -> Path:
    p = workdir / "gemini.key"
    p.write_text(KEY + "\n")
    return p


@pytest.fixture(scope="module")
def fake(workdir: Path, key_file: Path) -> Iterator[Fake]:
    f = start_fake(workdir, key_file)
    try:
        yield f
    finally:
        f.process.stop()


def stack_of(
    workdir: Path, fake: Fake, key_file: Path, body_mode: str, cache: dict[str, Any], name: str,
    ca_file: str | None = None, envoy_over: dict[str, Any] | None = None,
) -> Iterator[Stack]:  # fmt: skip
    backends = start_backends(1, workdir)
    picker = envoy = None
    try:
        gemini = {"name": "gemini", "type": "gemini", "base_url": fake.base_url, "api_key_file": str(key_file),
                  "models": [MODEL], "allow_insecure": fake.base_url.startswith("http:")}  # fmt: skip
        cfg = {"pool": {"backends": [*backends.pool(), gemini]}, "gemini_context_cache": cache}
        picker = start_picker(cfg, workdir, name=name)
        derived = derive(parse_settings(picker.config), Given(mode="sidecar", body_mode=body_mode))  # type: ignore[arg-type]
        opts = EnvoyOptions(**{
            **derived.options, **picker.envoy_picker_options(),
            "listen_port": free_port(), "listen_address": "127.0.0.1", "admin_port": free_port(),
            "backends": tuple(b["address"] for b in backends.pool()),
            **({"external_ca_file": ca_file} if ca_file else {}), **(envoy_over or {}),
        })  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield Stack(backends, picker, envoy, fake)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        backends.process.stop()


NATIVE = {"enabled": True, "min_prefix_bytes": 16384, "prefer_native_api": True}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def native(request: pytest.FixtureRequest, workdir: Path, fake: Fake, key_file: Path) -> Iterator[Stack]:
    yield from stack_of(workdir, fake, key_file, request.param, NATIVE, f"gemini-native-{request.param}")


@pytest.fixture(scope="module")
def compat(workdir: Path, fake: Fake, key_file: Path) -> Iterator[Stack]:
    yield from stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", {**NATIVE, "prefer_native_api": False},
                        "gemini-compat")  # fmt: skip


@pytest.fixture(scope="module")
def disabled(workdir: Path, fake: Fake, key_file: Path) -> Iterator[Stack]:
    yield from stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", {"prefer_native_api": True}, "gemini-off")


def chat_body(system: str, user: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 8, **kw}  # fmt: skip


def until(what: Any, timeout_s: float = 20.0) -> Any:
    """Poll ``what()`` until it is truthy (a background create finishing), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def sse_events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[6:]))
    return out


def test_a_long_system_prompt_is_cached_once_and_then_referenced_without_its_text(native: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"  # a prompt no other test sends
    before = native.fake.stats()["creates"]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda i: native.chat(chat_body(system, f"first {i}")), range(10)))
    for a in answers:  # forwarded at once, converted to the OpenAI shape
        assert a.status == 200, a.body[:300]
        doc = a.json()
        assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"].startswith("echo:")
    assert until(lambda: native.cache_stats()["entries"] == 1), native.cache_stats()
    assert native.fake.stats()["creates"] - before == 1  # single-flight: one resource for 10 first requests
    later = native.chat(chat_body(system, "later"))
    assert later.status == 200
    usage = later.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 4000  # the 20 KB prefix, from the cache
    assert usage["prompt_tokens"] >= usage["prompt_tokens_details"]["cached_tokens"]
    sent = native.fake.stats()["requests"][-1]
    assert sent["path"] == f"/v1beta/models/{MODEL}:generateContent"
    assert sent["body"]["cachedContent"].startswith("cachedContents/") and "systemInstruction" not in sent["body"]
    streamed = native.chat(chat_body(system, "streamed", stream=True, stream_options={"include_usage": True}))
    assert streamed.status == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.body)
    assert events[0]["object"] == "chat.completion.chunk" and streamed.body.endswith(b"data: [DONE]\n\n")
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 4000
    stats = native.cache_stats()
    assert stats["hit"] >= 2 and stats["cached_tokens"] > 8000


def test_the_first_request_does_not_wait_for_the_create(native: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"
    native.fake.control(hold_creates=True)
    try:
        a = native.chat(chat_body(system, "first"))
        assert a.status == 200  # answered while its create is still held in the fake
        assert native.cache_stats()["in_flight"] == 1
    finally:
        native.fake.control(hold_creates=False)
    assert until(lambda: native.cache_stats()["in_flight"] == 0)


def test_a_request_with_tools_never_references_a_cached_prompt(native: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"
    native.chat(chat_body(system, "warm"))
    assert until(lambda: native.cache_stats()["entries"] >= 1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    a = native.chat(chat_body(system, "with tools", tools=tools))
    assert a.status == 200, a.body[:300]  # Google refuses a cachedContent beside tools: none is sent
    sent = native.fake.stats()["requests"][-1]
    assert sent["path"] == "/v1beta/openai/chat/completions" and "extra_body" not in sent["body"]


def test_a_prompt_under_the_threshold_creates_nothing(native: Stack) -> None:
    before = native.fake.stats()["creates"]
    ineligible = native.cache_stats()["ineligible"]
    a = native.chat(chat_body("short system prompt", "hi"))
    assert a.status == 200 and a.json()["choices"][0]["message"]["content"].startswith("echo:")
    assert native.cache_stats()["ineligible"] == ineligible + 1
    assert native.fake.stats()["creates"] == before


def test_a_refused_creation_is_not_retried_within_the_negative_ttl(native: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"
    native.fake.control(fail_next_create=400)
    before = native.fake.stats()["creates"]
    assert native.chat(chat_body(system, "one")).status == 200
    assert until(lambda: native.cache_stats()["negative_entries"] >= 1)
    after_refusal = native.fake.stats()["creates"]
    assert native.chat(chat_body(system, "two")).status == 200  # still answered, as sent
    assert native.cache_stats()["negative"] >= 1
    assert native.fake.stats()["creates"] == after_refusal and after_refusal - before <= 1


def test_the_admin_stats_and_clear_answer_the_seeds_json(native: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"
    native.chat(chat_body(system, "warm"))
    assert until(lambda: native.cache_stats()["entries"] >= 1)
    stats = native.cache_stats()
    for key in ("enabled", "entries", "negative_entries", "in_flight", "backends", "hit", "miss", "ineligible",
                "negative", "creates", "create_failures", "evictions", "cached_tokens"):  # fmt: skip
        assert key in stats, key
    entries = stats["entries"]
    deletes = native.fake.stats()["deletes"]
    cleared = http("POST", native.picker.admin_url + "/admin/gemini-context-cache/clear").json()
    assert cleared == {"success": True, "cleared_entries": entries}
    assert until(lambda: native.fake.stats()["deletes"] - deletes == entries)  # storage billing stops
    assert native.cache_stats()["entries"] == 0


def test_the_engines_models_route_to_the_pool_as_before(native: Stack) -> None:
    a = native.chat({"model": "some-engine-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert a.status == 200
    assert "echo:" not in json.dumps(a.json())  # the echo engine's answer, not the fake Gemini's


def test_the_openai_compatible_endpoint_gets_the_reference_in_extra_body(compat: Stack) -> None:
    system = f"{uuid.uuid4()} {SYSTEM_20K}"
    assert compat.chat(chat_body(system, "first")).status == 200
    assert until(lambda: compat.cache_stats()["entries"] == 1)
    later = compat.chat(chat_body(system, "later"))
    assert later.status == 200 and later.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 4000
    sent = compat.fake.stats()["requests"][-1]
    assert sent["path"] == "/v1beta/openai/chat/completions"
    assert sent["body"]["extra_body"]["google"]["cached_content"].startswith("cachedContents/")
    assert all(m["role"] not in ("system", "developer") for m in sent["body"]["messages"])


def test_with_the_cache_off_nothing_is_created_and_clear_says_so(disabled: Stack) -> None:
    before = disabled.fake.stats()["creates"]
    for i in range(2):
        a = disabled.chat(chat_body(SYSTEM_20K, f"q{i}"))
        assert a.status == 200 and a.json()["object"] == "chat.completion"  # still converted (native API)
    sent = disabled.fake.stats()["requests"][-1]
    assert "cachedContent" not in sent["body"] and "systemInstruction" in sent["body"]
    assert disabled.fake.stats()["creates"] == before
    assert disabled.cache_stats()["enabled"] is False
    r = http("POST", disabled.picker.admin_url + "/admin/gemini-context-cache/clear")
    assert r.json() == {"success": False, "error": "Gemini context cache is not enabled"}


def test_envoy_reaches_an_https_host_by_name_with_sni_and_a_verified_certificate(workdir: Path, key_file: Path) -> None:
    ca = TestCA()
    cert, key = workdir / "fake-gemini.crt", workdir / "fake-gemini.key"
    write_pair(ca.issue("localhost"), cert, key)  # its certificate names localhost
    ca_file = ca.write_ca(workdir / "fake-gemini-ca.pem")
    fake = start_fake(workdir, key_file, tls=(cert, key))
    try:
        for stack in stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", {}, "gemini-tls", str(ca_file)):
            a = stack.chat(chat_body("be brief", "over tls"))
            assert a.status == 200, a.body[:300]
            assert a.json()["choices"][0]["message"]["content"].startswith("echo:")
            # the fake's answer: Envoy resolved localhost, sent SNI localhost and verified the test CA's certificate
        other = TestCA("another CA").write_ca(workdir / "another-ca.pem")
        for stack in stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", {}, "gemini-tls-bad", str(other)):
            assert stack.chat(chat_body("be brief", "over tls")).status == 503  # a certificate it cannot verify
    finally:
        fake.process.stop()


def test_without_response_bodies_the_native_api_is_not_used_and_answers_stay_openai(
    workdir: Path, fake: Fake, key_file: Path
) -> None:
    """Envoy's response mode none (the picker could not convert a native answer): the compatible endpoint."""
    over = {"response_mode": "none"}
    for stack in stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", NATIVE, "gemini-none", envoy_over=over):
        a = stack.chat(chat_body("be brief", "no bodies"))
        assert a.status == 200 and a.json()["object"] == "chat.completion"
        assert fake.stats()["requests"][-1]["path"] == "/v1beta/openai/chat/completions"


def test_an_envoy_without_the_external_route_answers_503_and_never_the_pool(
    workdir: Path, fake: Fake, key_file: Path
) -> None:
    """An Envoy generated before the gemini backend was added: the picker's choice finds no route; the request
    (with the API key on it) must not take the pool's route to an engine."""
    over = {"external_upstreams": ()}
    for stack in stack_of(workdir, fake, key_file, "FULL_DUPLEX_STREAMED", {}, "gemini-noroute", envoy_over=over):
        before = stack.backends.stats(0)
        a = stack.chat(chat_body("be brief", "no route"))
        assert a.status == 503 and a.json()["error"]["code"] == "no_external_route"
        assert stack.backends.stats(0) == before  # the engine saw nothing
