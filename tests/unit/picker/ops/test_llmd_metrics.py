"""llm-d's metric names beside ours (picker.ops.llmd): after a few requests through a real request stream, the
canonical llm_d_epp_* families and their deprecated aliases carry llm-d's label sets and the expected counts; the
picker's own answers are llm-d's error codes; client-derived labels fold to ``other`` past their caps; and
``metrics.compat`` decides what /metrics exports."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import generate_latest

from picker.config import ConfigError, parse_settings
from picker.extproc.stream import RequestStream
from picker.facts import Answer
from picker.ops import llmd
from picker.ops.llmd import (
    MAX_FAIRNESS_LABELS,
    MAX_MODEL_LABELS,
    MAX_REQUEST_SERIES,
    OTHER,
    LlmdMetrics,
    exported,
)
from picker.pool.exposition import Exposition, Sample, parse_exposition
from picker.request.path import Inbound
from picker.routing.endpoints import EngineSignals
from picker.runtime.app import PickerApp
from tests.support.builders import app_of

PM = processing_mode_pb2.ProcessingMode
BACKENDS = [{"name": "a", "address": "10.0.0.1:8000"}, {"name": "b", "address": "10.0.0.2:8001"}]
USAGE = {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}}


def make_app(**extra: Any) -> PickerApp:
    return app_of({"pool": {"backends": BACKENDS}, **extra})


def scrape(app: PickerApp) -> Exposition:
    app.refresh_gauges()
    text = generate_latest(exported(app.metrics.registry, app.settings.metrics.compat)).decode()
    return parse_exposition(text, max_samples=100_000)


def series(expo: Exposition, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {s.labels: s.value for s in expo.samples if s.name == name}


def one(expo: Exposition, family: str, /, **labels: str) -> Sample:
    found = [s for s in expo.samples if s.name == family and all(s.label(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, labels, found)
    return found[0]


def label_names(expo: Exposition, name: str) -> set[str]:
    return {k for s in expo.samples if s.name == name for k, _ in s.labels}


async def full_exchange(
    app: PickerApp,
    body: dict[str, Any] | bytes,
    headers: dict[str, str] | None = None,
    status: int = 200,
    response: bytes = b"",
) -> RequestStream:
    """One request through a real stream in full-duplex bodies with every response chunk sent (response mode full):
    the request, the response headers, the response body in two chunks."""
    stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
    req = pb.ProcessingRequest()
    req.protocol_config.request_body_mode = PM.FULL_DUPLEX_STREAMED
    req.protocol_config.response_body_mode = PM.FULL_DUPLEX_STREAMED
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"), *(headers or {}).items()):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    await stream.handle(req)
    msg = pb.ProcessingRequest()
    msg.request_body.body = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg.request_body.end_of_stream = True
    await stream.handle(msg)
    if stream.exchange is None:
        return stream  # answered by the picker
    r = pb.ProcessingRequest()
    h = r.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", str(status).encode()
    await stream.handle(r)
    half = len(response) // 2
    for i, chunk in enumerate((response[:half], response[half:])):
        m = pb.ProcessingRequest()
        m.response_body.body = chunk
        m.response_body.end_of_stream = i == 1
        await stream.handle(m)
    stream.close()
    return stream


def sse(usage: dict[str, Any]) -> bytes:
    return (
        b'data: {"choices":[{"delta":{"content":"hello"}}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )


def chat(model: str = "m", stream: bool = True) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


REQUEST_LABELS = {"model_name", "target_model_name", "fairness_id", "priority"}


async def test_request_families_after_a_few_requests_in_full_mode() -> None:
    app = make_app(flow_control={"objectives": {"premium": {"priority": 2}}})
    fairness = {"x-llm-d-inference-fairness-id": "tenant-a", "x-llm-d-inference-objective": "premium"}
    for _ in range(2):
        await full_exchange(app, chat(), fairness, response=sse(USAGE))
    await full_exchange(app, chat(stream=False), response=json.dumps({"usage": USAGE}).encode())
    expo = scrape(app)
    labels = {"model_name": "m", "target_model_name": "m", "fairness_id": "tenant-a", "priority": "2"}
    assert one(expo, "llm_d_epp_request_total", **labels).value == 2
    assert one(expo, "llm_d_epp_request_total", fairness_id="default-flow", priority="0").value == 1
    assert one(expo, "llm_d_epp_request_running", **labels).value == 0  # both ended
    for name in ("request_total", "request_running"):
        assert label_names(expo, "llm_d_epp_" + name) == REQUEST_LABELS
    for hist in (
        "request_duration_seconds", "request_size_bytes", "response_size_bytes", "request_input_tokens",
        "request_output_tokens", "request_cached_tokens", "request_ntpot_seconds", "request_streaming_tpot_seconds",
    ):  # fmt: skip
        assert one(expo, f"llm_d_epp_{hist}_count", **labels).value == 2, hist
        assert label_names(expo, f"llm_d_epp_{hist}_bucket") == REQUEST_LABELS | {"le"}, hist
    assert one(expo, "llm_d_epp_request_input_tokens_sum", **labels).value == 80
    assert one(expo, "llm_d_epp_request_output_tokens_sum", **labels).value == 10
    assert one(expo, "llm_d_epp_request_cached_tokens_sum", **labels).value == 64
    assert one(expo, "llm_d_epp_response_size_bytes_sum", **labels).value == 2 * len(sse(USAGE))
    ttft = series(expo, "llm_d_epp_request_ttft_seconds_count")
    assert sorted((dict(k)["streaming"], v) for k, v in ttft.items()) == [("false", 1), ("true", 2)]
    assert label_names(expo, "llm_d_epp_request_ttft_seconds_bucket") == REQUEST_LABELS | {"streaming", "le"}
    # the deprecated aliases: llm-d's older label sets, summed over what they do not carry
    assert one(expo, "inference_objective_request_total", model_name="m", priority="2").value == 2
    assert label_names(expo, "inference_objective_request_total") == {"model_name", "target_model_name", "priority"}
    assert one(expo, "inference_objective_request_duration_seconds_count", model_name="m").value == 3
    assert one(expo, "inference_objective_input_tokens_sum", model_name="m").value == 120
    assert label_names(expo, "inference_objective_response_sizes_bucket") == {"model_name", "target_model_name", "le"}
    assert one(expo, "inference_objective_running_requests", model_name="m").value == 0
    # scheduler and overhead
    assert one(expo, "llm_d_epp_scheduler_e2e_duration_seconds_count").value == 3
    assert one(expo, "inference_extension_scheduler_e2e_duration_seconds_count").value == 3
    attempts = series(expo, "llm_d_epp_scheduler_attempts_total")
    assert sum(attempts.values()) == 3
    assert {dict(k)["status"] for k in attempts} == {"success"}
    assert {dict(k)["endpoint_name"] for k in attempts} <= {"a", "b"}
    assert {dict(k)["port"] for k in attempts} <= {"8000", "8001"}
    assert label_names(expo, "inference_extension_scheduler_attempts_total") == {
        "status", "target_model_name", "pod_name", "namespace", "port",
    }  # fmt: skip
    plugin = series(expo, "llm_d_epp_plugin_duration_seconds_count")
    assert sum(plugin.values()) == 3 and {dict(k)["extension_point"] for k in plugin} == {"decide"}
    assert label_names(expo, "llm_d_epp_info") == {"commit", "build_ref"}
    assert series(expo, "llm_d_epp_inflight_requests") == {}  # nothing in flight after the ends


async def test_in_flight_and_running_while_the_response_streams() -> None:
    app = make_app()
    stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
    req = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST")):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    await stream.handle(req)
    msg = pb.ProcessingRequest()
    msg.request_body.body = json.dumps(chat()).encode()
    msg.request_body.end_of_stream = True
    await stream.handle(msg)
    assert stream.exchange is not None
    name = stream.exchange.lease.endpoint.name
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_running", model_name="m").value == 1
    inflight = one(expo, "llm_d_epp_inflight_requests", endpoint_name=name)
    assert dict(inflight.labels).keys() == {"endpoint_name", "namespace", "producer_name", "fairness_id", "priority"}
    assert inflight.value == 1
    assert one(expo, "llm_d_epp_inflight_tokens", endpoint_name=name).value > 0  # the body's estimate
    stream.close()  # aborted before any response: no longer running, no duration
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_running", model_name="m").value == 0
    assert series(expo, "llm_d_epp_inflight_requests") == {}
    assert series(expo, "llm_d_epp_request_duration_seconds_count") == {}


async def test_the_pickers_own_answers_and_upstream_errors_are_llm_d_error_codes() -> None:
    app = make_app()
    await full_exchange(app, b"{not json")  # 400
    subset = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
    req = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST")):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    hint = req.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    hint.fields["x-gateway-destination-endpoint-subset"].list_value.values.add().string_value = "10.9.9.9:1"
    await subset.handle(req)
    body = pb.ProcessingRequest()
    body.request_body.body = json.dumps(chat("n")).encode()
    body.request_body.end_of_stream = True
    await subset.handle(body)  # nothing eligible in the subset: 503
    await full_exchange(app, chat("p"), status=500, response=b'{"error":"boom"}')
    await full_exchange(app, chat("q"), {"prefer": "if-available"})  # Tier 4 off: nothing known cached, 412
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_error_total", error_code="PreconditionFailed", model_name="q").value == 1
    assert one(expo, "llm_d_epp_request_error_total", error_code="BadRequest", model_name="").value == 1
    assert one(expo, "llm_d_epp_request_error_total", error_code="ServiceUnavailable", model_name="n").value == 1
    assert one(expo, "llm_d_epp_request_error_total", error_code="ModelServerError", model_name="p").value == 1
    assert label_names(expo, "llm_d_epp_request_error_total") == REQUEST_LABELS | {"error_code"}
    assert one(expo, "inference_objective_request_error_total", error_code="BadRequest").value == 1
    assert one(expo, "llm_d_epp_scheduler_attempts_total", status="failure").value == 1
    assert one(expo, "llm_d_epp_request_total", model_name="p").value == 1  # sent upstream, then failed there


def test_model_and_fairness_labels_fold_to_other_past_their_caps() -> None:
    m = LlmdMetrics()
    for i in range(MAX_MODEL_LABELS + 5):
        assert m.models.bound(f"model-{i}") == (f"model-{i}" if i < MAX_MODEL_LABELS else OTHER)
    for i in range(MAX_FAIRNESS_LABELS + 5):
        assert m.fairness.bound(f"tenant-{i}") == (f"tenant-{i}" if i < MAX_FAIRNESS_LABELS else OTHER)
    assert m.models.bound("model-3") == "model-3"  # admitted values stay themselves
    # the label sets together: past MAX_REQUEST_SERIES a new set is (other, other, other, priority)
    for i in range(MAX_REQUEST_SERIES + 5):
        m.answered("model-0", f"tenant-{i % MAX_FAIRNESS_LABELS}", str(i // MAX_FAIRNESS_LABELS), 400, 10, None)
    assert len(m.series) == MAX_REQUEST_SERIES + 1
    assert m.series[(OTHER, OTHER, OTHER, "1")].errors["BadRequest"] == 5
    assert m.series[("model-0", "model-0", "tenant-3", "0")].errors["BadRequest"] == 1
    m.models.pin("configured-model")  # llm-d pins its rewrite rules' names: they never fold
    assert m.models.bound("configured-model") == "configured-model"
    assert m.models.bound("x" * 10_000) == OTHER  # a new value past the cap, however long


def test_the_series_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llmd, "MAX_REQUEST_SERIES", 10)
    m = LlmdMetrics()
    for i in range(30):
        m.answered(f"model-{i}", "f", "1", 429, 10, None)
    assert len(m.series) == 11  # ten label sets and the overflow set
    assert m.series[(OTHER, OTHER, OTHER, "1")].errors["ResourceExhausted"] == 20


async def test_pool_families_from_the_engines_own_signals() -> None:
    app = make_app(metrics={"pool_name": "pool-x"})
    app.pool.set_engine_signals("a", EngineSignals(waiting=4, running=2, kv_usage=0.5))
    app.pool.set_engine_signals("b", EngineSignals(waiting=2, running=6, kv_usage=0.25))
    expo = scrape(app)
    for canonical, alias, value in (
        ("average_kv_cache_utilization", "inference_pool_average_kv_cache_utilization", 0.375),
        ("average_queue_size", "inference_pool_average_queue_size", 3.0),
        ("average_running_requests", "inference_pool_average_running_requests", 4.0),
        ("ready_endpoints", "inference_pool_ready_pods", 2.0),
    ):
        assert one(expo, "llm_d_epp_" + canonical, name="pool-x").value == value
        assert one(expo, alias, name="pool-x").value == value
    assert one(expo, "llm_d_epp_per_endpoint_queue_size", name="pool-x", model_server_endpoint="a").value == 4
    assert one(expo, "inference_pool_per_pod_queue_size", name="pool-x", model_server_pod="b").value == 2


async def test_compat_decides_what_metrics_exports() -> None:
    both = make_app()
    await full_exchange(both, chat(), response=sse(USAGE))
    names = {s.name for s in scrape(both).samples}
    assert {"llm_d_epp_request_total", "inference_objective_request_total", "continuum_picker_requests_total"} <= names
    llm_d = make_app(metrics={"compat": "llm-d"})
    await full_exchange(llm_d, chat(), response=sse(USAGE))
    names = {s.name for s in scrape(llm_d).samples}
    assert "llm_d_epp_request_total" in names and "inference_objective_request_total" in names
    assert "kv_epp_responses_observed_total" in names  # ours that are not continuum_* stay
    assert not [n for n in names if n.startswith("continuum_")]
    cont = make_app(metrics={"compat": "continuum"})
    await full_exchange(cont, chat(), response=sse(USAGE))
    names = {s.name for s in scrape(cont).samples}
    assert "continuum_picker_requests_total" in names
    assert not [n for n in names if n.startswith(("llm_d_epp_request", "inference_", "llm_d_epp_ready"))]
    assert cont.recorder.llmd.series == {}  # not even booked


async def test_compat_is_hot_reloadable() -> None:
    app = make_app(metrics={"compat": "continuum"})
    app.apply(parse_settings({"pool": {"backends": BACKENDS}, "metrics": {"compat": "both"}}))
    await full_exchange(app, chat(), response=sse(USAGE))
    assert one(scrape(app), "llm_d_epp_request_total", model_name="m").value == 1


@pytest.mark.parametrize(
    ("metrics", "path"), [({"compat": "llmd"}, "metrics.compat"), ({"pool_name": ""}, "metrics.pool_name")]
)
def test_a_bad_metrics_config_is_refused_with_its_path(metrics: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"metrics": metrics})
    assert [p for p, _ in err.value.problems] == [path]


async def test_sampled_mode_books_the_sampled_responses_tokens_and_a_non_streamed_ttft() -> None:
    """Response mode sampled (BUFFERED bodies): the body of an opted-in response reaches the picker, so its usage is
    booked; a non-streamed response's time to first token is its response headers' (they come with the answer).
    Response sizes need every body (mode full): none here."""
    app = make_app(extproc={"response_sample_rate": 0.0})
    for sample in (True, False):
        stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
        req = pb.ProcessingRequest()
        req.protocol_config.request_body_mode = PM.BUFFERED
        req.protocol_config.response_body_mode = PM.NONE
        opt_in = (("x-kv-epp-sample", "1"),) if sample else ()
        for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"), *opt_in):
            h = req.request_headers.headers.headers.add()
            h.key, h.raw_value = k, v.encode()
        await stream.handle(req)
        body = pb.ProcessingRequest()
        body.request_body.body = json.dumps(chat(stream=False)).encode()
        body.request_body.end_of_stream = True
        await stream.handle(body)
        r = pb.ProcessingRequest()
        h = r.response_headers.headers.headers.add()
        h.key, h.raw_value = ":status", b"200"
        (answer,) = await stream.handle(r)
        assert answer.HasField("mode_override") == sample
        if sample:
            m = pb.ProcessingRequest()
            m.response_body.body = json.dumps({"usage": USAGE}).encode()
            m.response_body.end_of_stream = True
            await stream.handle(m)
        stream.close()
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_total", model_name="m").value == 2
    assert one(expo, "llm_d_epp_request_input_tokens_count", model_name="m").value == 1  # the sampled one
    assert one(expo, "llm_d_epp_request_ntpot_seconds_count", model_name="m").value == 1
    assert one(expo, "llm_d_epp_request_ttft_seconds_count", model_name="m", streaming="false").value == 2
    assert one(expo, "llm_d_epp_request_duration_seconds_count", model_name="m").value == 2
    assert series(expo, "llm_d_epp_response_size_bytes_count") == {}


async def test_a_backend_that_leaves_the_pool_loses_its_scheduling_series() -> None:
    app = make_app()
    for i in range(6):
        await full_exchange(app, chat(f"m{i}"), response=sse(USAGE))
    endpoints = {dict(k)["endpoint_name"] for k in series(scrape(app), "llm_d_epp_scheduler_attempts_total")}
    assert endpoints == {"a", "b"}
    app.apply(parse_settings({"pool": {"backends": BACKENDS[:1]}}))  # b leaves the pool
    endpoints = {dict(k)["endpoint_name"] for k in series(scrape(app), "llm_d_epp_scheduler_attempts_total")}
    assert endpoints == {"a"}


async def test_the_model_rewrites_models_keep_their_labels_past_the_cap() -> None:
    """As llm-d pins its InferenceModelRewrite names: a rule's matched model and its targets are never ``other``,
    and the request is labelled with the model asked for and the model sent."""
    rewrites = [{"name": "canary", "rules": [{"matches": [{"model": {"value": "alias"}}],
                                              "targets": [{"modelRewrite": "m-v2"}]}]}]  # fmt: skip
    app = make_app(model_rewrites=rewrites)
    m = app.recorder.llmd
    for i in range(MAX_MODEL_LABELS):  # the cap is full before any request of the rewrite
        m.answered(f"flood-{i}", "f", "0", 400, 10, None)
    await full_exchange(app, chat("alias"), response=sse(USAGE))
    await full_exchange(app, chat("unconfigured"), response=sse(USAGE))
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_total", model_name="alias", target_model_name="m-v2").value == 1
    assert one(expo, "llm_d_epp_request_total", model_name=OTHER, target_model_name=OTHER).value == 1


def test_the_request_families_render_apart_from_the_rest_of_the_registry() -> None:
    """``/metrics`` collects the registry with the request families deferred (on the event loop) and renders them
    from the series in a worker thread: each family appears in exactly one of the two parts."""
    app = make_app()
    app.recorder.llmd.answered("m", "f", "0", 400, 10, None)
    c = app.recorder.llmd_collector
    c.deferred = True
    try:
        head = generate_latest(app.metrics.registry).decode()
    finally:
        c.deferred = False
    series = c.request_series()
    assert series
    tail = c.render_requests(series).decode()
    assert "llm_d_epp_request_error_total{" not in head and "llm_d_epp_ready_endpoints" in head
    assert 'llm_d_epp_request_error_total{error_code="BadRequest"' in tail and "llm_d_epp_ready_endpoints" not in tail
    assert "llm_d_epp_request_error_total{" in generate_latest(app.metrics.registry).decode()  # not deferred: whole


async def test_a_gemini_backend_without_its_api_key_is_an_error_not_a_failed_scheduling_attempt(tmp_path) -> None:
    """The 503 of a ``type: gemini`` backend whose API key cannot be read never reached the decide stage: it is a
    ServiceUnavailable error of its model, and no failed scheduling attempt (only "no eligible endpoint" is)."""
    gemini = {"name": "g", "type": "gemini", "models": ["gem"], "api_key_file": str(tmp_path / "missing")}
    app = make_app(pool={"backends": [*BACKENDS, gemini]})
    body = json.dumps(chat("gem", stream=False)).encode()
    out = await app.path.route(Inbound("/v1/chat/completions", {":method": "POST"}, body))
    assert isinstance(out, Answer) and out.status == 503 and b"no_api_key" in out.body
    expo = scrape(app)
    assert one(expo, "llm_d_epp_request_error_total", model_name="gem").value == 1
    attempts = [s for s in expo.samples if s.name == "llm_d_epp_scheduler_attempts_total"]
    assert not [s for s in attempts if s.label("status") == "failure"], attempts
