"""The sidecar's small rules (picker.pdsidecar.proxy, picker.pdsidecar.allowlist): which headers are forwarded,
which prefill target a request names, when --prefill-failure local falls back, and the SSRF allowlist."""

from __future__ import annotations

from multidict import CIMultiDict

from picker.pdsidecar.allowlist import Allowlist, Verdict
from picker.pdsidecar.proxy import PrefillFailure, forwarded, prefill_target
from picker.shared.discovery import DiscoveredBackend, PoolSnapshot
from picker.shared.discovery.config import canonical_ip_port


def test_forwarded_drops_hop_by_hop_headers_and_ours() -> None:
    headers = CIMultiDict([
        ("Host", "h"), ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "5"), ("TE", "trailers"),
        ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"), ("Expect", "100-continue"), ("Proxy-Authorization", "p"),
        ("X-Prefiller-Host-Port", "10.0.0.1:8000"), ("x-prefiller-host-port", "10.0.0.2:8000"), ("X-A", "1"),
        ("X-A", "2"), ("Authorization", "Bearer t"), ("Content-Length", "3"),
    ])  # fmt: skip
    assert list(forwarded(headers).items()) == [
        ("Host", "h"), ("X-A", "1"), ("X-A", "2"), ("Authorization", "Bearer t"), ("Content-Length", "3"),
    ]  # fmt: skip
    assert list(forwarded(headers, frozenset({"host", "content-length"})).items()) == [
        ("X-A", "1"), ("X-A", "2"), ("Authorization", "Bearer t"),
    ]  # fmt: skip


def test_prefill_target_is_the_first_non_empty_value() -> None:
    assert prefill_target([]) is None
    assert prefill_target(["", " , "]) is None
    assert prefill_target(["10.0.0.1:8000"]) == "10.0.0.1:8000"
    assert prefill_target([" 10.0.0.1:8000 , 10.0.0.2:8000"]) == "10.0.0.1:8000"
    assert prefill_target(["10.0.0.1:8000", "10.0.0.2:8000"]) == "10.0.0.1:8000"
    assert prefill_target([",10.0.0.2:8000"]) == "10.0.0.2:8000"


def test_local_fallback_skips_the_4xx_a_local_prefill_would_repeat() -> None:
    def http(status: int) -> PrefillFailure:
        return PrefillFailure("http_error", status, "")

    assert not http(400).may_fall_back and not http(404).may_fall_back and not http(422).may_fall_back
    assert http(408).may_fall_back and http(429).may_fall_back and http(500).may_fall_back and http(503).may_fall_back
    for kind in ("connect_error", "timeout", "bad_answer"):
        assert PrefillFailure(kind, 502, "").may_fall_back


def backend(name: str, ip: str, port: int, ready: bool = True) -> DiscoveredBackend:
    return DiscoveredBackend(name=name, ip=ip, port=port, ready=ready)


def test_a_static_allowlist() -> None:
    allowlist = Allowlist.static(frozenset({"10.0.0.1:8000", "[fd00::1]:8000"}))
    assert allowlist.check("10.0.0.1:8000") is Verdict.ALLOWED
    assert allowlist.check("10.0.0.1:8001") is Verdict.NOT_IN_POOL  # the pod, another port: not the pool's
    assert allowlist.check(canonical_ip_port("[fd00:0::0:1]:8000")) is Verdict.ALLOWED  # canonical forms compared
    assert allowlist.check("10.0.0.2:8000") is Verdict.NOT_IN_POOL


def test_a_followed_allowlist_is_the_last_snapshot_ready_or_not() -> None:
    changes: list[int] = []
    allowlist = Allowlist.follow("file f", lambda: changes.append(len(allowlist)))
    assert allowlist.check("10.0.0.1:8000") is Verdict.NOT_SYNCED
    allowlist.publish(PoolSnapshot((backend("a", "10.0.0.1", 8000), backend("b", "fd00::1", 8000, ready=False)), "s"))
    assert allowlist.synced and changes == [2]
    assert allowlist.check("10.0.0.1:8000") is Verdict.ALLOWED
    assert allowlist.check("[fd00::1]:8000") is Verdict.ALLOWED  # not ready is still the pool's
    allowlist.publish(PoolSnapshot((backend("b", "fd00::1", 8000),), "s"))
    assert allowlist.check("10.0.0.1:8000") is Verdict.NOT_IN_POOL
    allowlist.publish(PoolSnapshot((), "s"))
    assert allowlist.check("[fd00::1]:8000") is Verdict.NOT_IN_POOL and changes == [2, 1, 0]


def test_protection_off_allows_anything() -> None:
    allowlist = Allowlist.off()
    assert not allowlist.protecting and allowlist.check("203.0.113.9:22") is Verdict.ALLOWED
