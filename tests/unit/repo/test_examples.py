"""The example configs in examples/ stay valid (the README points users at them), agree with each other and with
kv-sim's defaults, and are what `make up` runs (benchmarks.local_stack with the default ports)."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import local_stack
from benchmarks.engine_sim.__main__ import SERVED_MODEL
from benchmarks.engine_sim.__main__ import build_parser as kv_sim_parser
from listener.config import load_listener_config
from picker.config import config_warnings, load_settings
from picker.runtime.cli import build_parser as kv_epp_parser

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PICKERS = ("picker.yaml", "picker-kv-aware.yaml")


def raw(name: str) -> dict[str, Any]:
    data = yaml.safe_load((EXAMPLES / name).read_text())
    assert isinstance(data, dict)
    return data


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_picker_examples_are_valid_without_warnings() -> None:
    files = sorted(EXAMPLES.glob("picker*.yaml"))
    assert [f.name for f in files] == sorted(PICKERS)
    for f in files:
        assert config_warnings(load_settings(f)) == [], f


def test_listener_example_is_valid() -> None:
    cfg = load_listener_config(EXAMPLES / "listener.yaml")
    assert [s.backend_name for s in cfg.sources] == ["vllm-0", "vllm-1"]


def test_the_examples_agree_with_each_other() -> None:
    """One pool (names, addresses), one feed (the listener's sources, the picker's feed URLs), one block
    size, one model, one picker address, all on 127.0.0.1."""
    plain, kv = (load_settings(EXAMPLES / name) for name in PICKERS)
    listener = load_listener_config(EXAMPLES / "listener.yaml")
    pool = [(b.name, b.address) for b in kv.pool.backends]
    assert [(b.name, b.address) for b in plain.pool.backends] == pool
    assert all(address.startswith("127.0.0.1:") for _, address in pool)
    names = [name for name, _ in pool]
    assert [s.backend_name for s in listener.sources] == names
    assert [s.backend_name for s in kv.kv_cache_index.event_sources] == names
    assert [s.endpoint for s in kv.kv_cache_index.event_sources] == [
        f"http://{listener.listen}/events/{name}" for name in names
    ]
    assert kv.kv_cache_index.tokenizer.block_size == listener.key_block_size
    assert {s.model for s in listener.sources} == {SERVED_MODEL}
    for s in listener.sources:
        assert s.zmq_endpoint is not None and s.zmq_endpoint.startswith("tcp://127.0.0.1:")
        assert s.replay_endpoint is not None and s.replay_endpoint.startswith("tcp://127.0.0.1:")
    for section in ("extproc", "admin"):
        assert getattr(plain, section) == getattr(kv, section), section
    assert kv.extproc.host == kv.admin.host == "127.0.0.1"


def test_the_first_engine_of_the_examples_is_kv_sims_defaults() -> None:
    """`kv-sim` with no flags serves what the examples' first backend expects: its name, port, model, block
    size and KV event ports (the second engine changes only its name and ports)."""
    sim = kv_sim_parser().parse_args([])
    listener = load_listener_config(EXAMPLES / "listener.yaml")
    kv = load_settings(EXAMPLES / "picker-kv-aware.yaml")
    first, source = kv.pool.backends[0], listener.sources[0]
    assert (first.name, port(first.address)) == (sim.name, sim.port)
    assert sim.model == SERVED_MODEL == source.model
    assert sim.block_size == listener.key_block_size == kv.kv_cache_index.tokenizer.block_size
    assert source.zmq_endpoint is not None and source.replay_endpoint is not None
    assert port(source.zmq_endpoint) == port(sim.kv_events_endpoint)
    assert port(source.replay_endpoint) == port(sim.kv_events_replay_endpoint)
    # kv-sim binds its default endpoints (vLLM's rule: a wildcard host), so the listener can connect to them
    assert sim.kv_events_endpoint.startswith("tcp://*:") and sim.kv_events_replay_endpoint.startswith("tcp://*:")


def test_make_up_runs_the_examples_on_the_default_ports() -> None:
    """The configs `make up` writes are the examples, key for key, unless ports are asked to move."""
    ports = local_stack.example_ports()
    assert local_stack.picker_config(ports) == raw("picker-kv-aware.yaml")
    assert local_stack.listener_config(ports) == raw("listener.yaml")
    assert raw("listener.yaml")["state"]["path"] == local_stack.LISTENER_STATE_FILE
    envoy_defaults = kv_epp_parser().parse_args(["envoy-config"])
    assert (ports.envoy, ports.envoy_admin) == (envoy_defaults.listen_port, envoy_defaults.admin_port)
    engines = local_stack.engines(local_stack.picker_config(ports), local_stack.listener_config(ports), ports)
    assert [(e.name, e.model) for e in engines] == [("vllm-0", SERVED_MODEL), ("vllm-1", SERVED_MODEL)]


def test_make_up_moves_every_port_consistently() -> None:
    ports = local_stack.free_ports(local_stack.example_ports())
    assert len(set(ports.named().values())) == len(ports.named())
    picker, listener = local_stack.picker_config(ports), local_stack.listener_config(ports)
    assert [port(b["address"]) for b in picker["pool"]["backends"]] == list(ports.engine_http)
    assert [port(s["zmq_endpoint"]) for s in listener["sources"]] == list(ports.engine_events)
    assert [port(s["replay_endpoint"]) for s in listener["sources"]] == list(ports.engine_replay)
    assert {s["endpoint"] for s in picker["kv_cache_index"]["event_sources"]} == {
        f"http://127.0.0.1:{ports.listener}/events/{name}" for name in ("vllm-0", "vllm-1")
    }
    assert (picker["extproc"]["port"], picker["extproc"]["health_port"], picker["admin"]["port"]) == (
        ports.extproc,
        ports.health,
        ports.admin,
    )
    assert listener["listen"] == f"127.0.0.1:{ports.listener}"


def test_the_printed_snippets_name_the_url_and_model() -> None:
    curl, py = local_stack.snippets("http://127.0.0.1:18080", SERVED_MODEL)
    assert curl.startswith("curl -sS http://127.0.0.1:18080/v1/chat/completions ") and SERVED_MODEL in curl
    assert 'base_url="http://127.0.0.1:18080/v1"' in py and f'model="{SERVED_MODEL}"' in py
    compile(py, "<snippet>", "exec")


@pytest.mark.parametrize("name", PICKERS)
def test_kv_epp_validate_accepts_the_picker_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from picker.runtime.cli import main

    assert main(["config", "validate", str(EXAMPLES / name)]) == 0
    assert capsys.readouterr().out == f"ok: {EXAMPLES / name}\n"
