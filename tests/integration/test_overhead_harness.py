"""The overhead harness on real processes, briefly: the trivial upstreams, Envoy alone, the no-op ext_proc
floor and the picker all serve every request with 200 (a broken floor would make the ratios meaningless),
the front Envoy reuses its upstream connections, a second picker configuration is one more entry in the
variant list, and the streaming row streams every SSE chunk through every path.
No timing assertions: the figures come from `python -m benchmarks.overhead`."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.overhead import (
    DEFAULT,
    STREAM_TOKENS,
    Variant,
    backend_addresses,
    compare_modes_variant,
    decision_cpu_us,
    ext_proc_settings,
    format_row,
    format_tables,
    latency_row,
    measure_row,
    measure_streaming,
    parse_variant,
    start_sse_upstream,
    start_upstream,
)
from benchmarks.stack import make_workdir
from picker.api import EnvoyOptions

PATHS = ("envoy_only", "floor", "picker")


def _reused(res: dict[str, Any], backends: int, conns: int) -> None:
    """At most one upstream connection per (backend, client connection), a handful more for retries:
    never one per request."""
    assert 0 < res["upstream_cx"] <= backends * conns + 2, res
    assert res["upstream_rq"] >= 10 * res["upstream_cx"], res


@pytest.mark.envoy
def test_rows_serve_every_request_and_reuse_upstream_connections() -> None:
    workdir = make_workdir("kv-epp-ovh-test-")
    upstream, port = start_upstream(workdir)
    variants = [DEFAULT, parse_variant("buffered:body_mode=BUFFERED")]
    try:
        row = measure_row(workdir, backend_addresses(2, port), 4096, "FULL_DUPLEX_STREAMED", 0.3, 2, variants=variants)
    finally:
        upstream.stop()
    assert set(row["pickers"]) == {"default", "buffered"}
    # Different request body modes: each configuration gets its own floor, following its bootstrap's modes.
    assert set(row["floors"]) == {"default", "buffered"}
    assert row["floors"]["buffered"]["ext_proc"]["processing_mode"]["request_body_mode"] == "BUFFERED"
    everything = {**{n: row[n] for n in PATHS}, **row["floors"], **{f"p-{k}": v for k, v in row["pickers"].items()}}
    for name, r in everything.items():
        assert r["rps"] > 0 and r["latency_requests"] > 0 and r["errors"] == 0 and r["non_200"] == 0, (name, r)
        _reused(r, 2, 2)
    for r in [*row["floors"].values(), *row["pickers"].values()]:
        assert r["cpu_us_per_req"] is not None and r["cpu_us_per_req"] > 0, r
        assert r["p50_added_ms"] == pytest.approx(r["p50_ms"] - row["envoy_only"]["p50_ms"], abs=1e-3)
    assert row["envoy_only"]["cpu_us_per_req"] is None  # no ext_proc server
    assert row["throughput_ratio"] == pytest.approx(row["picker"]["rps"] / row["floor"]["rps"], abs=1e-3)
    lr = latency_row([row])
    assert lr is not None and set(lr["paths"]) == {
        "envoy_only", "floor[default]", "floor[buffered]", "picker[default]", "picker[buffered]",
    }  # fmt: skip
    assert "picker[buffered]" in format_row(row)


def test_floor_follows_the_generated_modes() -> None:
    """The floor's modes are read from the bootstrap the picker gets, whatever its defaults are."""
    opts = EnvoyOptions(picker_address="127.0.0.1:1", backends=("127.0.0.1:2",))
    settings = ext_proc_settings(opts)
    assert settings is not None and settings["processing_mode"]["request_body_mode"] == opts.body_mode
    assert ext_proc_settings(EnvoyOptions(picker_address=None, backends=("127.0.0.1:2",))) is None


def test_variant_spec() -> None:
    v = parse_variant("x:body_mode=BUFFERED,picker.extproc.tls.mode=plaintext,fail_open=true")
    assert v == Variant("x", {"body_mode": "BUFFERED", "fail_open": True}, {"extproc": {"tls": {"mode": "plaintext"}}})
    with pytest.raises(ValueError):
        parse_variant("x:no_such_field=1")


@pytest.mark.envoy
def test_streaming_row_streams_every_chunk() -> None:
    workdir = make_workdir("kv-epp-ovh-stream-")
    sse, port = start_sse_upstream(workdir)
    try:
        sec = measure_streaming(workdir, port, 0.3, clients=2)
    finally:
        sse.stop()
    for name in PATHS:
        for phase in ("streamed", "non_streamed"):
            r = sec[name][phase]
            assert r["requests"] > 0 and r["errors"] == 0 and r["non_200"] == 0, (name, phase, r)
        st = sec[name]["streamed"]
        assert st["chunks_per_req"] == STREAM_TOKENS + 2, (name, st)  # the tokens, the usage chunk, [DONE]
        assert st["chunks_per_s"] > 0
        _reused(sec[name], 2, 2)
    for name in ("floor", "picker"):
        assert sec[name]["streamed"]["cpu_us_per_req"] > 0 and sec[name]["non_streamed"]["cpu_us_per_req"] > 0
        assert sec[name]["chunks_ratio_vs_envoy"] > 0
    assert "picker[default]" in format_tables({"params": {"concurrency": 2}, "streaming": sec})


def test_decision_cpu_routes_every_request() -> None:
    """``decision_cpu_us`` raises when the request path does not route a request, so this fails on a broken
    path; the figure itself is not asserted (a duration is always > 0, and bounds would be timing-sensitive)."""
    decision_cpu_us(4096, 2, iterations=50)


def test_compare_modes_names_the_response_switch() -> None:
    """``--compare-modes`` is one more variant: the EnvoyOptions response-mode field set to its full value
    (or a clear refusal while EnvoyOptions has no such field)."""
    try:
        v = compare_modes_variant()
    except SystemExit as e:
        assert "--variant" in str(e)
        return
    [(name, value)] = v.envoy.items()
    assert "response" in name and "full" in value
    EnvoyOptions(picker_address="127.0.0.1:1", backends=("127.0.0.1:2",), **v.envoy)  # a valid configuration
