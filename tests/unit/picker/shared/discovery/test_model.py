"""What a discovery source publishes: a backend's canonical address and annotations, a snapshot's names and the
names to route to, and the backend naming rule the picker and the listener both derive names with."""

from __future__ import annotations

import pytest

from picker.shared.discovery.model import DiscoveredBackend, PoolSnapshot, backend_name


@pytest.mark.parametrize(
    ("ip", "port", "address"),
    [
        ("10.0.0.7", 8000, "10.0.0.7:8000"),
        ("fd00:0:0::7", 8000, "[fd00::7]:8000"),  # compressed, in brackets: the picker's canonical form
        ("FD00::A", 1, "[fd00::a]:1"),
    ],
)
def test_a_backends_address_is_the_pickers_canonical_ip_port(ip: str, port: int, address: str) -> None:
    assert DiscoveredBackend(name="p", ip=ip, port=port).address == address


def test_an_annotation_is_looked_up_by_key_and_absent_ones_are_none() -> None:
    b = DiscoveredBackend(name="p", ip="10.0.0.1", port=80, annotations=(("kv-epp/events", "tcp://x:5557"),))
    assert b.annotation("kv-epp/events") == "tcp://x:5557"
    assert b.annotation("kv-epp/other") is None
    assert DiscoveredBackend(name="p", ip="10.0.0.1", port=80).annotation("kv-epp/events") is None


def test_a_snapshot_lists_every_backend_and_routes_only_to_the_ready_ones() -> None:
    snapshot = PoolSnapshot(
        (
            DiscoveredBackend(name="a", ip="10.0.0.1", port=80),
            DiscoveredBackend(name="b", ip="10.0.0.2", port=80, ready=False),
            DiscoveredBackend(name="c", ip="10.0.0.3", port=80),
        ),
        source="test",
    )
    assert snapshot.names() == ("a", "b", "c")
    assert snapshot.ready_names() == ("a", "c")
    assert PoolSnapshot((), source="test").ready_names() == ()


@pytest.mark.parametrize(
    ("rank", "ports", "name"),
    [(0, 1, "vllm-0"), (0, 0, "vllm-0"), (0, 2, "vllm-0.rank0"), (3, 4, "vllm-0.rank3")],
)
def test_a_pod_is_one_backend_named_after_it_or_one_per_rank_when_the_pool_has_several_ports(
    rank: int, ports: int, name: str
) -> None:
    assert backend_name("vllm-0", rank, ports) == name
