"""listener.config: bad keys and values name their dotted path, unreadable files; the discovery config: source
templates (placeholders, data-parallel ranks, IPv6), pod annotations (overrides, bad ones). Applying snapshots to a
running listener is in app/test_discovery.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from listener.config import (
    DiscoveryConfig,
    ListenerConfigError,
    SourceConfig,
    SourceTemplate,
    TemplateError,
    load_listener_config,
    offset_endpoint,
    parse_listener_config,
)
from picker.shared.discovery import DiscoveredBackend

PREFIX = "kv-epp.io/"
POOL = {"inference_pool": {"name": "pool"}}


def backend(
    rank: int = 0, ip: str = "10.1.2.3", port: int = 8000, pod: str = "vllm-7f9c", **ann: str
) -> DiscoveredBackend:
    name = pod if rank == 0 and not ann.pop("_dp", "") else f"{pod}.rank{rank}"
    annotations = tuple(sorted((PREFIX + k.replace("_", "-"), v) for k, v in ann.items()))
    return DiscoveredBackend(name=name, ip=ip, port=port, rank=rank, pod=pod, namespace="ns", annotations=annotations)


def render(b: DiscoveredBackend, **template: Any) -> SourceConfig:
    return SourceTemplate(model="m", **template).render(b, PREFIX)


def test_defaults_give_the_vllm_ports_of_rank_0() -> None:
    s = render(backend())
    assert (s.backend_name, s.engine, s.model) == ("vllm-7f9c", "vllm", "m")
    assert s.zmq_endpoint == "tcp://10.1.2.3:5557" and s.replay_endpoint == "tcp://10.1.2.3:5558"
    assert s.http_endpoint is None and s.zmq_mode == "connect"


@pytest.mark.parametrize("rank", [1, 2, 7])
def test_data_parallel_rank_offsets_publisher_and_replay_ports(rank: int) -> None:
    """vLLM's (and SGLang's) ZmqEventPublisher binds base port + data-parallel rank, replay too."""
    s = render(backend(rank=rank))
    assert s.backend_name == f"vllm-7f9c.rank{rank}"
    assert s.zmq_endpoint == f"tcp://10.1.2.3:{5557 + rank}"
    assert s.replay_endpoint == f"tcp://10.1.2.3:{5558 + rank}"


def test_explicit_rank_or_port_in_the_template_is_not_offset() -> None:
    s = render(backend(rank=3), zmq_endpoint="tcp://{ip}:600{rank}", replay_endpoint="tcp://{ip}:{port}")
    assert s.zmq_endpoint == "tcp://10.1.2.3:6003" and s.replay_endpoint == "tcp://10.1.2.3:8000"


def test_offset_follows_vllm_for_tcp_ipc_and_inproc() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[fd00::1]:5557", 1) == "tcp://[fd00::1]:5558"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    for bad in ("tcp://host", "tcp://host:65535"):
        with pytest.raises(ValueError):
            offset_endpoint(bad, 1)


def test_ipv6_in_brackets_in_urls_and_bare_in_allowed_publishers() -> None:
    s = render(backend(ip="fd00:0:0::7"), allowed_publishers=("{ip}",), topic="kv.{namespace}.{pod}")
    assert s.zmq_endpoint == "tcp://[fd00::7]:5557" and s.allowed_publishers == ("fd00::7",)
    assert s.topic == "kv.ns.vllm-7f9c"
    t = render(backend(ip="fd00::7", port=8001), engine="trtllm")
    assert t.http_endpoint == "http://[fd00::7]:8001" and t.zmq_endpoint is None


def test_annotations_override_the_template_per_pod() -> None:
    b = backend(
        rank=1,
        zmq_endpoint="tcp://{ip}:7000",
        replay_endpoint="",
        model="llama-3-8b",
        engine="sglang",
    )
    s = render(b)
    assert s.engine == "sglang" and s.model == "llama-3-8b"
    assert s.zmq_endpoint == "tcp://10.1.2.3:7001"  # the annotation is a base endpoint: the rank still offsets it
    assert s.replay_endpoint is None  # empty: no replay endpoint
    other = DiscoveredBackend(
        name="p", ip="10.0.0.9", port=1, annotations=(("example.com/model", "x"), ("kv-epp.io/unrelated", "y"))
    )
    assert render(other).model == "m"  # another prefix, or a key not ours: ignored
    trt = render(backend(engine="trtllm", http_endpoint="https://{ip}:9443"))
    assert trt.engine == "trtllm" and trt.http_endpoint == "https://10.1.2.3:9443"


@pytest.mark.parametrize(
    ("annotations", "says"),
    [
        ({"engine": "tgi"}, "kv-epp.io/engine"),
        ({"zmq_endpoint": "tcp://{host}:1"}, "unknown placeholder"),
        ({"zmq_endpoint": "http://x:1"}, "zmq_endpoint"),
        ({"zmq_endpoint": "tcp://{ip}:{ip.__class__}"}, "unknown placeholder"),
        ({"zmq_endpoint": "tcp://{ip}:5557\n"}, "control"),
        ({"model": "x" * 2000}, "longer than"),
        ({"engine": "trtllm", "http_endpoint": "ftp://{ip}"}, "http_endpoint"),
        ({"_dp": "1", "zmq_endpoint": "tcp://{ip}:65535"}, "passes 65535"),
    ],
)
def test_a_bad_annotation_is_refused_with_what_is_wrong(annotations: dict[str, str], says: str) -> None:
    rank = int(annotations.get("_dp", "0"))
    with pytest.raises(TemplateError) as exc:
        render(backend(rank=rank, **annotations))
    assert exc.value.kind == "bad_annotation" and says in str(exc.value), str(exc.value)


def test_a_template_that_does_not_fit_one_backend_is_bad_backend() -> None:
    t = SourceTemplate(model="m", zmq_endpoint="tcp://{ip}:65535", replay_endpoint=None)
    assert t.render(backend(), PREFIX).zmq_endpoint == "tcp://10.1.2.3:65535"
    with pytest.raises(TemplateError) as exc:
        t.render(backend(rank=1), PREFIX)
    assert exc.value.kind == "bad_backend"


def test_literal_braces_are_escaped_like_str_format() -> None:
    assert render(backend(), topic="{{kv}}.{pod}").topic == "{kv}.vllm-7f9c"


def refused(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ListenerConfigError) as exc:
        parse_listener_config(data)
    return exc.value.problems


def test_config_errors_name_their_path() -> None:
    source = {"backend_name": "e1", "model": "m", "zmq_endpoint": "tcp://127.0.0.1:1"}
    template = {"model": "m"}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"sources": [source], "discovery": {**POOL, "source_template": template}}, "discovery", "exclusive"),
        ({"discovery": POOL}, "discovery.source_template", "needs a source_template"),
        ({"discovery": {"source_template": template}}, "discovery", "inference_pool or backends_file"),
        (
            {"discovery": {**POOL, "backends_file": {"path": "b.yaml"}, "source_template": template}},
            "discovery.backends_file",
            "exclusive",
        ),
        (
            {"discovery": {**POOL, "source_template": {**template, "zmq_endpoint": "tcp://{host}:5557"}}},
            "discovery.source_template.zmq_endpoint",
            "unknown placeholder {host}",
        ),
        (
            {"discovery": {**POOL, "source_template": {**template, "zmq_mode": "bind"}}},
            "discovery.source_template.zmq_mode",
            "connect",
        ),
        (
            {"discovery": {**POOL, "source_template": {**template, "engine": "trtllm", "http_endpoint": "{ip}"}}},
            "discovery.source_template",
            "http_endpoint",
        ),
        ({"discovery": {**POOL, "source_template": {}}}, "discovery.source_template.model", "required"),
        (
            {"discovery": {**POOL, "annotation_prefix": "Kv/", "source_template": template}},
            "discovery.annotation_prefix",
            "",
        ),
        (
            {"discovery": {"inference_pool": {"name": "Pool"}, "source_template": template}},
            "discovery.inference_pool.name",
            "",
        ),
    ]
    for data, path, says in cases:
        problems = refused(data)
        assert any(p == path and says in m for p, m in problems), (data, problems)


def test_a_valid_discovery_config() -> None:
    cfg = parse_listener_config(
        {
            "discovery": {
                "backends_file": {"path": "backends.yaml"},
                "annotation_prefix": "example.com/",
                "source_template": {"engine": "sglang", "model": "qwen", "allowed_publishers": ["{ip}"]},
            }
        }
    )
    d = cfg.discovery
    assert isinstance(d, DiscoveryConfig) and cfg.sources == ()
    assert d.template.engine == "sglang" and d.max_sources == 1024


def test_readiness_does_not_change_a_backends_source() -> None:
    """The listener compares rendered sources to decide what to drop: a Ready flap must render the same source
    (readiness gates the picker's routing only; the engine's events are followed all along)."""
    ready = backend(zmq_endpoint="tcp://{ip}:6000")
    unready = dataclasses.replace(ready, ready=False)
    assert not unready.ready and render(unready) == render(ready)


# -- every config: paths of bad keys, files ----------------------------------------------------------------------
SOURCE = {"backend_name": "vllm-0", "model": "m", "zmq_endpoint": "tcp://127.0.0.1:5557"}


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"sources": [{**SOURCE, "backend_name": "bad name"}]}, "sources[0].backend_name"),
        ({"sources": [{**SOURCE, "bogus": 1}]}, "sources[0].bogus"),
        ({"sources": [{**SOURCE, "engine": "tgi"}]}, "sources[0].engine"),
        ({"sources": [{**SOURCE, "zmq_endpoint": None}]}, "sources[0]"),
        ({"sources": [{**SOURCE, "engine": "trtllm"}]}, "sources[0]"),
        ({"limits": {"max_tracked_blocks": 0}}, "limits.max_tracked_blocks"),
    ],
)
def test_bad_keys_name_their_path(data: dict, path: str) -> None:
    with pytest.raises(ListenerConfigError) as exc:
        parse_listener_config(data)
    assert path in [p for p, _ in exc.value.problems], exc.value.problems


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ListenerConfigError):
        load_listener_config(tmp_path / "missing.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ListenerConfigError) as exc:
        load_listener_config(f)
    assert exc.value.problems[0][0] == "<root>"
