"""Real ``vllm serve`` processes (the CPU build) on free ports, for the real-engine tests and benchmarks.

``VllmProcess`` has the attributes the harnesses read from a simulator (``config.name``, ``config.model``,
``config.block_size``, ``address``, ``base_url``, ``kv_events_endpoint``, ``replay_endpoint``), so the same
``PolicyStack`` runs in front of either. Each engine runs from the engines' virtual environment
(``.venv-engines``, ``make engines-venv``), serves the tiny model of ``benchmarks.vllm_engine.model``,
publishes its KV events over ZMQ with replay, reports ``cached_tokens`` in ``usage`` and runs in dev mode
(``POST /reset_prefix_cache``). It is started in a session of its own (vLLM forks an engine core and a
worker) and stopped by its pid's process group: SIGTERM, then SIGKILL after a grace period.

Facts of the CPU build this relies on (docs/real-engines.md): ``--block-size`` must be a multiple of 32;
``VLLM_CPU_KVCACHE_SPACE`` is in GiB and ``--num-gpu-blocks-override`` bounds the cache in pages; a start
takes tens of seconds on two cores.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from benchmarks.stack import free_port

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
# absolute: engines may run in another working directory (make up runs them in its state dir)
ENGINES_VENV = Path(os.environ.get("KV_EPP_ENGINES_VENV", ROOT / ".venv-engines")).resolve()
MODEL_NAME = "kv-epp-tiny-llama"  # the served model name
START_TIMEOUT_S = 300.0  # a cold start compiles the model: 40-120 s on two busy cores
LOG_TAIL_BYTES = 4000
# vLLM binds its internal ZMQ sockets on ports it picks itself (bind to port 0, close, bind again later): two
# engines starting at once could each pick a port the other, or the KV-event ports picked here, takes first
# ("Address already in use" at engine start, seen in CI). Each engine gets its own VLLM_PORT base instead, below
# the kernel's ephemeral range (32768+) that free_port() draws from; vLLM scans upward from it for a free port.
INTERNAL_PORT_BASE = 20000
INTERNAL_PORTS_PER_ENGINE = 100
INTERNAL_PORT_SLOTS = 120  # bases 20000..31900, then they repeat (an old engine is long gone by then)
_internal_slots = itertools.count()


class EngineUnavailable(RuntimeError):
    """The engines' environment is missing (``make engines-venv`` creates it)."""


def engines_python() -> Path:
    """The engines' interpreter; EngineUnavailable when the environment has not been made."""
    py = ENGINES_VENV / "bin" / "python"
    if not (ENGINES_VENV / "bin" / "vllm").exists():
        raise EngineUnavailable(f"no vLLM at {ENGINES_VENV}: run `make engines-venv` (KV_EPP_ENGINES_VENV moves it)")
    return py


def _build(args: list[str], what: str, timeout_s: float) -> Path:
    """Run a builder module with the engines' interpreter; the path it prints last (its cached output)."""
    out = subprocess.run(
        [str(engines_python()), "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"building {what} failed: {out.stderr[-LOG_TAIL_BYTES:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def ensure_model(timeout_s: float = 600.0) -> Path:
    """The tiny model's directory, built on first use by the engines' interpreter (cached on disk)."""
    return _build(["benchmarks.vllm_engine.model"], "the tiny model", timeout_s)


def ensure_adapter(model_dir: Path, name: str = "kv-epp-tiny-lora", timeout_s: float = 300.0) -> Path:
    """A LoRA adapter for the tiny model (``benchmarks.vllm_engine.lora``), built on first use by the engines'
    interpreter and cached beside the model."""
    return _build(["benchmarks.vllm_engine.lora", str(model_dir), "--name", name], "the LoRA adapter", timeout_s)


KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass(frozen=True)
class KvTransfer:
    """vLLM's ``ExampleConnector`` (the shared-storage connector; llm-d's sidecar calls the mode ``shared-storage``).
    An engine writes each new prompt's KV to ``shared_storage_path`` (a folder per prompt, named by a hash of its
    token ids up to its last full page before its last token, a safetensors file per layer), and an engine asked for
    a prompt found there loads it instead of computing it. vLLM 0.32's connector does both whatever ``role`` says: a
    consumer's local prefill is written too (docs/pd.md, "On real vLLM"). Nothing is ever removed from the storage.
    """

    role: KvRole
    shared_storage_path: Path
    connector: str = "ExampleConnector"

    def config(self) -> dict[str, Any]:
        """The value of ``--kv-transfer-config``."""
        return {
            "kv_connector": self.connector,
            "kv_role": self.role,
            "kv_connector_extra_config": {"shared_storage_path": str(self.shared_storage_path)},
        }


@dataclass(frozen=True)
class VllmConfig:
    """One engine's settings; the defaults suit the 2-core machines here."""

    name: str = "vllm-0"
    model: str = MODEL_NAME
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    num_gpu_blocks: int | None = 512  # --num-gpu-blocks-override: the KV cache in pages (None: what fits)
    kvcache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 8192
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    omp_threads: int = 1
    # bfloat16 (vLLM's default for this model) falls back to slow kernels on CPUs without AVX-512 BF16
    dtype: str = "float32"
    enforce_eager: bool = True  # skips torch.compile: a start in ~40 s instead of minutes; prefill cost alike
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # run at this niceness (0: as the caller): a benchmark that shares the cores with the picker, Envoy and the
    # load generator gives them the CPU first, as their own nodes would (vLLM's own processes inherit it)
    nice: int = 0
    # pin the engine (and its processes) to these CPUs (empty: wherever the scheduler puts it): a benchmark can
    # give the engines some cores and the picker, Envoy and the clients the others, as separate nodes would
    cpus: tuple[int, ...] = ()
    # P/D: a KV connector (None: none, as every engine before issue 24). With one, the engine prefills every prompt
    # in one step: chunked prefill off and --max-num-batched-tokens at least max_model_len (None: max_model_len).
    # The connector stores a prompt's KV from the step that schedules it first: a chunk would store a part under the
    # whole prompt's name, and the consumer's worker dies loading it (a tensor shape mismatch, docs/wire.md §6).
    kv_transfer: KvTransfer | None = None


def engine_env(cfg: VllmConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(cfg.kvcache_space_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=str(cfg.omp_threads),
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    )
    return env


class VllmProcess:
    """One ``vllm serve``; ``start()`` blocks until ``/health`` answers 200 and the model is listed."""

    def __init__(self, config: VllmConfig, model_dir: Path, log_path: Path | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = 0
        self.events_port = 0
        self.replay_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self.starts = 0
        slot = next(_internal_slots) % INTERNAL_PORT_SLOTS
        self.internal_port_base = INTERNAL_PORT_BASE + slot * INTERNAL_PORTS_PER_ENGINE  # VLLM_PORT

    def command(self) -> list[str]:
        c = self.config
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        cmd = [
            str(ENGINES_VENV / "bin" / "vllm"), "serve", str(self.model_dir),
            "--served-model-name", c.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(c.block_size),
            "--dtype", c.dtype,
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs),
            "--kv-events-config", json.dumps(kv_events),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if c.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(c.num_gpu_blocks)]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if c.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(c.kv_transfer.config()), "--no-enable-chunked-prefill"]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        prefix = ["nice", "-n", str(c.nice)] if c.nice else []
        if c.cpus:
            prefix += ["taskset", "-c", ",".join(map(str, c.cpus))]
        return [*prefix, *cmd, *c.extra_args]

    @property
    def max_model_len(self) -> int:
        """vLLM refuses to start when one request of max_model_len would not fit the cache (less its one reserved
        null page): a bounded cache bounds the model length too."""
        c = self.config
        if c.num_gpu_blocks is None:
            return c.max_model_len
        return min(c.max_model_len, (c.num_gpu_blocks - 1) * c.block_size)

    @property
    def max_num_batched_tokens(self) -> int | None:
        """The configured budget (None: vLLM's default); with a KV connector, at least ``max_model_len``, so that no
        prompt the engine accepts is ever prefilled in chunks (a smaller budget is refused here, not at the first
        long prompt)."""
        c = self.config
        if c.kv_transfer is None:
            return c.max_num_batched_tokens
        if c.max_num_batched_tokens is None:
            return self.max_model_len
        if c.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"{c.name}: a KV connector needs --max-num-batched-tokens >= max_model_len ({self.max_model_len}), "
                f"not {c.max_num_batched_tokens}: a prompt prefilled in chunks is stored in part (docs/wire.md §6)"
            )
        return c.max_num_batched_tokens

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start on free ports (the same ports again after a ``stop``, as a restarted pod keeps its own)."""
        engines_python()
        if not self.port:
            self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self._log_file = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self._proc = subprocess.Popen(
            self.command(),
            cwd=ROOT,
            env={**engine_env(self.config), "VLLM_PORT": str(self.internal_port_base)},
            stdin=subprocess.DEVNULL,
            stdout=self._log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log_file else subprocess.DEVNULL,
            start_new_session=True,  # its engine core and worker share the group: stopped together
        )
        self.starts += 1
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("vllm_ready name=%s url=%s pid=%d", self.config.name, self.base_url, self._proc.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vllm {self.config.name} exited with {self._proc.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2) as r:
                    if r.status == 200 and self.config.model in r.read().decode():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm {self.config.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        data = self.log_path.read_bytes()[-LOG_TAIL_BYTES:]
        return data.decode(errors="replace")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the engine's process group, SIGKILL after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            with contextlib.suppress(ProcessLookupError):  # a child left behind by a crash
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """A real engine restart on the same ports: a cold cache, and the event sequence starts again at 0."""
        self.stop()
        self.start(timeout_s)

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Dev mode's ``POST /reset_prefix_cache``: ``{"success": bool}`` (false while a request runs). The engine
        publishes ``AllBlocksCleared`` with its next step's events, not at once."""
        req = urllib.request.Request(self.base_url + "/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def __enter__(self) -> VllmProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_engines(
    configs: list[VllmConfig], model_dir: Path, log_dir: Path | None = None, timeout_s: float = START_TIMEOUT_S
) -> list[VllmProcess]:
    """Start every engine at once (each start is mostly one process waiting on another: overlapping them
    saves about a third on two cores); stops them all if one fails."""
    import threading

    engines = [VllmProcess(c, model_dir, log_dir / f"{c.name}.log" if log_dir else None) for c in configs]
    errors: list[BaseException] = []

    def start(e: VllmProcess) -> None:
        try:
            e.start(timeout_s)
        except BaseException as exc:  # re-raised below, after every start ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,), name=f"start-{e.config.name}") for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for e in engines:
            e.stop()
        raise errors[0]
    return engines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.vllm_engine.process [N]``: start N engines, print their URLs, wait for Ctrl-C."""
    n = int((argv or sys.argv[1:] or ["1"])[0])
    model = ensure_model()
    engines = start_engines([VllmConfig(name=f"vllm-{i}") for i in range(n)], model)
    try:
        for e in engines:
            print(json.dumps({"name": e.config.name, "url": e.base_url, "kv_events": e.kv_events_endpoint}), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EngineUnavailable", "KvRole", "KvTransfer", "VllmConfig", "VllmProcess", "ensure_model", "start_engines"]
