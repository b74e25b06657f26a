"""The real-engine tier (``make test-engines``): real ``vllm serve`` processes (the CPU build, from
``.venv-engines``) serving the tiny model of ``benchmarks.vllm_engine.model``, with the real kv-listener,
picker and Envoy in front. See docs/real-engines.md.

Two engines for the whole session, with different page sizes (``--block-size`` 32 and 64, what the CPU
build accepts; the picker keys 16-token blocks), each with a bounded cache. They are expensive to start
(tens of seconds each on two cores), so the tests share them and reset their prefix caches instead of
restarting them, except the test that is about a restart.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack import free_port, make_workdir, start_envoy, start_listener, start_picker
from benchmarks.vllm_engine.process import (
    MODEL_NAME,
    EngineUnavailable,
    KvRole,
    KvTransfer,
    VllmConfig,
    VllmProcess,
    ensure_model,
    start_engines,
)
from picker.api import EnvoyOptions
from tests.engines.pd_support import CONSUMER, PD_PAGE, PRODUCER, PdEngines, PdStack
from tests.engines.real_stack import PIN_HEADER, RealStack
from tests.support.kv_stack import kv_picker_config, listener_sources

PAGE_SIZES = (32, 64)
CACHE_PAGES = 384  # per engine: 12,288 tokens at 32, 24,576 at 64 (more than the tests' prompts need)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    try:
        return ensure_model()
    except EngineUnavailable as exc:  # the tier was asked for: a missing vLLM is a failure, not a skip
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def engines(model_dir: Path) -> Iterator[list[VllmProcess]]:
    workdir = make_workdir("kv-epp-engines-")
    configs = [VllmConfig(name=f"vllm-p{page}", block_size=page, num_gpu_blocks=CACHE_PAGES) for page in PAGE_SIZES]
    engines = start_engines(configs, model_dir, workdir)
    try:
        yield engines
    finally:
        for e in engines:
            e.stop()


PD_CACHE_PAGES = 256  # 8,192 tokens: max_model_len 8,160, and so the prefill budget (no chunked prefill)


@pytest.fixture(scope="session")
def pd_engines(model_dir: Path) -> Iterator[PdEngines]:
    """One producer (``kv_producer``) and one consumer (``kv_consumer``) for the session, started once, on a fresh
    shared-storage directory in the session's workdir (removed at the end; the logs stay)."""
    workdir = make_workdir("kv-epp-pd-engines-")
    storage = workdir / "kv-shared-storage"
    storage.mkdir()
    roles: tuple[tuple[str, KvRole], ...] = ((PRODUCER, "kv_producer"), (CONSUMER, "kv_consumer"))
    configs = [
        VllmConfig(name=name, block_size=PD_PAGE, num_gpu_blocks=PD_CACHE_PAGES, kv_transfer=KvTransfer(role, storage))
        for name, role in roles
    ]
    try:
        producer, consumer = start_engines(configs, model_dir, workdir)
        try:
            yield PdEngines(producer, consumer, storage, workdir)
        finally:
            producer.stop()
            consumer.stop()
    finally:
        shutil.rmtree(storage, ignore_errors=True)


@pytest.fixture(scope="session")
def pd_stack(pd_engines: PdEngines) -> Iterator[PdStack]:
    """The whole P/D stack on the session's producer and consumer: ``kv-epp pd-sidecar`` (shared storage) in front
    of the consumer, the kv-listener on both engines' events, the picker with disaggregation on (the producer's role
    ``prefill``, the consumer's ``decode`` at its sidecar's address) and a real Envoy."""
    st = PdStack(pd_engines)
    try:
        st.start()
        yield st
    finally:
        st.stop()


def listener_config(engines: list[VllmProcess], **extra: Any) -> dict[str, Any]:
    return {"feed": {"keepalive_seconds": 0.5}, "sources": listener_sources(engines, MODEL_NAME), **extra}


def picker_config(engines: list[VllmProcess], feed_url: str, **kv: Any) -> dict[str, Any]:
    """Tier 4 with the default (cost) scorer over the listener at ``feed_url``; the engine's own /tokenize,
    with generous waits: the engines' API servers share two cores with everything the tests run."""
    tokenizer = {"source": "engine", "timeout_ms": 5000, "timeout_max_ms": 10000, "block_size": 16}
    checks = {"self_check_timeout_seconds": 60, "ready_grace_seconds": 5, **kv.pop("checks", {})}
    return kv_picker_config(engines, feed_url, tokenizer=tokenizer, checks=checks, **kv)


def pinning_envoy(picker: Any, engines: list[VllmProcess], workdir: Path) -> Any:
    """The real Envoy in front of ``picker`` and the engines, the test's subset-hint header honoured (a request
    can be pinned to one engine), a first byte waited for up to 300 s (the engines share two busy cores)."""
    return start_envoy(
        EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                     subset_hint_from_header=PIN_HEADER, backends=tuple(e.address for e in engines),
                     first_byte_timeout_s=300, **picker.envoy_picker_options()),
        workdir,
    )  # fmt: skip


@pytest.fixture(scope="session")
def stack(engines: list[VllmProcess]) -> Iterator[RealStack]:
    """Listener (with a state file, on a fixed port across restarts) + picker + Envoy, and a reference
    listener and picker that never restart: the truth the restarted listener's index is compared with."""
    workdir = make_workdir("kv-epp-real-stack-")
    procs: list[Any] = []
    st: RealStack | None = None
    try:
        cfg = listener_config(
            engines,
            listen=f"127.0.0.1:{free_port()}",
            state={"path": str(workdir / "listener-state.bin"), "interval_seconds": 0.1},
        )
        ref_listener = start_listener(listener_config(engines), workdir, name="ref-listener")
        procs.append(ref_listener)
        st = RealStack(engines, workdir, cfg)
        st.start_listener()
        picker = start_picker(picker_config(engines, f"http://{cfg['listen']}"), workdir)
        procs.append(picker)
        ref_picker = start_picker(
            picker_config(engines, ref_listener.url, checks={"self_check": False}), workdir, name="ref-picker"
        )
        procs.append(ref_picker)
        envoy = pinning_envoy(picker, engines, workdir)
        procs.append(envoy)
        st.picker, st.ref_picker, st.envoy = picker, ref_picker, envoy
        yield st
    finally:
        if st is not None and st.listener is not None:
            st.listener.stop()
        for p in reversed(procs):
            p.stop()
