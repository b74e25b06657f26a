"""Experiments on the request path: each arm routes with its own config, every request of a session stays in its
arm, and each request becomes one decision-log record whose unknowns stay unknown."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import generate_latest

from picker.config import ConfigError, parse_settings
from picker.experiments.assign import session_of
from picker.experiments.runtime import ratio_bucket
from picker.extproc.stream import RequestStream
from picker.facts import RequestFacts
from picker.request.path import Inbound
from picker.runtime.app import PickerApp
from tests.support.builders import app_of, static_pool

PM = processing_mode_pb2.ProcessingMode


def config(tmp_path: Path, **experiments: Any) -> dict[str, Any]:
    exp = {
        "enabled": True,
        "decision_log": str(tmp_path / "decisions.jsonl"),
        "arms": {"a": {"selection_strategy": "RoundRobin"}, "b": {"selection_strategy": "ConsistentHash"}},
        **experiments,
    }
    return {"pool": static_pool(3), "session_affinity": {"header": "x-session-id"}, "experiments": exp}


def records(app: PickerApp, tmp_path: Path) -> list[dict[str, Any]]:
    assert app.path.experiments.close()  # every queued record written (the writer thread ended)
    return [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]


async def send(
    app: PickerApp,
    session: str | None,
    *,
    response_mode: int = PM.FULL_DUPLEX_STREAMED,
    body: bytes | None = None,
    status: int = 200,
    content: str = "hi",
    end: bool = True,
) -> RequestStream:
    """One request in full-duplex mode, its response headers and (where the response mode sends it) ``body``."""
    stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
    req = pb.ProcessingRequest()
    hdrs = [(":path", "/v1/chat/completions"), (":method", "POST"), ("x-request-id", "rid-1")]
    if session is not None:
        hdrs.append(("x-session-id", session))
    for k, v in hdrs:
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.protocol_config.request_body_mode = PM.FULL_DUPLEX_STREAMED  # type: ignore[assignment]
    req.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
    await stream.handle(req)
    msg = pb.ProcessingRequest()
    data = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
    msg.request_body.body = json.dumps(data).encode()
    msg.request_body.end_of_stream = True
    await stream.handle(msg)
    if stream.exchange is None:
        return stream  # answered by the picker
    h = pb.ProcessingRequest()
    h.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    await stream.handle(h)
    if body is not None and response_mode != PM.NONE:
        b = pb.ProcessingRequest()
        b.response_body.body = body
        b.response_body.end_of_stream = end
        await stream.handle(b)
    stream.close()
    return stream


def sse_usage(prompt: int, cached: int | None, completion: int = 4) -> bytes:
    details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached is not None else {}
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, **details}
    return (
        b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n'
        + b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
    )  # fmt: skip


async def test_each_arm_routes_with_its_own_config_and_a_session_keeps_its_arm(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    for i in range(40):
        for _ in range(2):
            await send(app, f"s{i}", body=sse_usage(100, 50))
    got = records(app, tmp_path)
    assert len(got) == 80
    arms: dict[str, set[str]] = {}
    for r in got:
        arms.setdefault(r["session"], set()).add(r["arm"])
        assert r["strategy"] == ("RoundRobin" if r["arm"] == "a" else "ConsistentHash")
    assert len(arms) == 40 and all(len(a) == 1 for a in arms.values())
    assert {next(iter(a)) for a in arms.values()} == {"a", "b"}
    stats = app.path.experiments.stats()
    assert stats["arms"]["a"]["requests"] + stats["arms"]["b"]["requests"] == 80
    assert stats["arms"]["a"]["sessions"] + stats["arms"]["b"]["sessions"] == 40
    assert stats["assignment_sources"]["header"] == 80


async def test_a_record_with_everything_the_full_response_mode_shows(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, "one", body=sse_usage(200, 150, 7))
    await send(app, "one", body=sse_usage(220, 200, 7))
    first, second = records(app, tmp_path)
    assert first["session"] == second["session"] and first["session_source"] == "header"
    assert (first["turn"], second["turn"]) == (1, 2)
    assert first["start_gap_s"] is None and second["start_gap_s"] >= 0 and second["idle_gap_s"] >= 0
    assert first["request_id"] == "rid-1" and first["model"] == "m" and first["stream"] is True
    assert first["endpoint"] in {"a", "b", "c"} and first["pod"] is None and first["namespace"] is None
    assert first["status"] == 200 and first["complete"] is True
    assert first["first_byte_s"] >= 0 and first["ttft_s"] >= first["first_byte_s"]
    assert first["usage"] == {"prompt_tokens": 200, "cached_tokens": 150, "completion_tokens": 7}
    assert first["preempt_window"] is None  # no engine scrape: unknown, not 0
    assert "hi" not in json.dumps(first)  # no prompt text
    text = generate_latest(app.metrics.registry).decode()
    arm = first["arm"]
    assert f'kv_epp_experiment_cached_ratio_requests_total{{arm="{arm}",bucket="(0.5,0.9]"}}' in text
    assert f'kv_epp_experiment_responses_total{{arm="{arm}",result="complete"}}' in text
    assert f'kv_epp_experiment_ttft_seconds_count{{arm="{arm}"}}' in text


async def test_without_the_response_body_usage_ttft_and_completion_are_unknown(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, "quiet", response_mode=PM.NONE, body=sse_usage(10, 10))
    (r,) = records(app, tmp_path)
    assert r["status"] == 200 and r["first_byte_s"] is not None
    assert r["ttft_s"] is None and r["complete"] is None
    assert r["usage"] == {"prompt_tokens": None, "cached_tokens": None, "completion_tokens": None}
    assert app.path.experiments.counts[r["arm"]].results["unknown"] == 1
    assert app.path.experiments.counts[r["arm"]].buckets["unknown"] == 1


async def test_a_response_that_does_not_end_is_incomplete_and_an_error_is_an_error(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, "cut", body=b'data: {"choices":[]}\n\n', end=False)  # the stream closes mid-body
    await send(app, "err", status=500, body=b'{"error":"x"}')
    cut, err = records(app, tmp_path)
    assert cut["complete"] is False and cut["usage"]["prompt_tokens"] is None
    assert err["status"] == 500
    exps = app.path.experiments
    assert exps.counts[cut["arm"]].results["incomplete"] == 1
    assert exps.counts[err["arm"]].results["error"] == 1


async def test_an_sse_stream_that_passed_its_terminal_event_is_complete(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, "done", body=sse_usage(10, 5), end=False)  # the client closed at [DONE], before the body's end
    (r,) = records(app, tmp_path)
    assert r["complete"] is True and r["usage"]["prompt_tokens"] == 10


async def test_the_pickers_own_answer_is_recorded_as_an_error(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    app.pool.update(app.settings.pool, [])  # no member left: 503 no_healthy_backend
    stream = await send(app, "nobody")
    assert stream.exchange is None
    (r,) = records(app, tmp_path)
    assert r["status"] == 503 and r["endpoint"] is None and r["complete"] is False


async def test_first_turn_sessions_without_a_header(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, None, body=sse_usage(10, 0), content="the same first message")
    await send(app, None, body=sse_usage(10, 0), content="the same first message")
    await send(app, None, body=sse_usage(10, 0), content="another conversation")
    a, b, c = records(app, tmp_path)
    assert a["session_source"] == "first_turn" and a["session"] == b["session"] != c["session"]
    assert (a["turn"], b["turn"], c["turn"]) == (1, 2, 1)


async def test_disabled_builds_nothing(tmp_path: Path) -> None:
    app = app_of({"pool": static_pool(2)})
    await send(app, "s", body=sse_usage(10, 5))
    exps = app.path.experiments
    assert not exps.enabled and exps.log is None and not exps.arms and len(exps.turns) == 0
    assert "kv_epp_experiment" not in generate_latest(app.metrics.registry).decode()
    assert exps.stats()["enabled"] is False


async def test_a_reload_keeps_the_counts_of_kept_arms_and_reopens_a_moved_log(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    for i in range(10):
        await send(app, f"s{i}", body=sse_usage(10, 5))
    before = {n: c.requests for n, c in app.path.experiments.counts.items()}
    new = config(tmp_path, decision_log=str(tmp_path / "second.jsonl"))
    new["experiments"]["arms"] = {"a": {"selection_strategy": "RoundRobin"}, "c": {"weight": 2}}
    app.apply(parse_settings(new))
    exps = app.path.experiments
    assert set(exps.counts) == {"a", "c"} and exps.counts["a"].requests == before["a"]
    await send(app, "later", body=sse_usage(10, 5))
    exps.close()
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 10
    assert len((tmp_path / "second.jsonl").read_text().splitlines()) == 1


def test_ratio_buckets_are_the_seeds() -> None:
    assert ratio_bucket(100, 0) == "0"
    assert ratio_bucket(100, 1) == ratio_bucket(100, 50) == "(0,0.5]"
    assert ratio_bucket(100, 51) == ratio_bucket(100, 90) == "(0.5,0.9]"
    assert ratio_bucket(100, 91) == ratio_bucket(100, 100) == "(0.9,1]"
    assert ratio_bucket(None, 5) == ratio_bucket(10, None) == ratio_bucket(0, 0) == "unknown"


@pytest.mark.parametrize(
    ("arm", "where"),
    [
        ({"extproc": {"port": 1}}, "experiments.arms.x.extproc"),
        ({"kv_cache_index": {"enabled": True}}, "experiments.arms.x.kv_cache_index.enabled"),
        ({"pool": {"backends": []}}, "experiments.arms.x.pool.backends"),
        ({"prefix_routing": {"load_factor_epsilon": 0}}, "experiments.arms.x.prefix_routing.load_factor_epsilon"),
        ({"weight": -1}, "experiments.arms.x.weight"),
    ],
)
def test_an_arm_that_cannot_apply_per_request_is_refused_with_its_path(arm: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"pool": static_pool(2), "experiments": {"enabled": True, "arms": {"x": arm}}})
    assert where in [p for p, _ in err.value.problems]


def test_enabled_needs_an_arm() -> None:
    with pytest.raises(ConfigError, match="at least one arm"):
        parse_settings({"experiments": {"enabled": True}})


async def test_a_client_that_leaves_while_queued_is_recorded_unrouted(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["pool"] = static_pool(1)
    cfg["flow_control"] = {"enabled": True, "saturation": {"in_flight_threshold": 1, "queue_depth_threshold": 0}}
    app = app_of(cfg)
    held = app.pool.acquire(app.pool.view().states[0].endpoint)  # saturated: the next request waits
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "wait"}]}).encode()
    inbound = Inbound("/v1/chat/completions", {":method": "POST", "x-session-id": "w"}, body)
    task = asyncio.create_task(app.path.route(inbound))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held.release()
    (r,) = records(app, tmp_path)
    assert r["status"] is None and r["endpoint"] is None and r["complete"] is False
    assert app.path.experiments.counts[r["arm"]].results["error"] == 1


async def test_a_trial_is_recorded_once_however_its_request_ends(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    stream = await send(app, "twice", body=sse_usage(10, 5))
    ex = stream.exchange
    assert ex is not None
    (trial,) = [o for o in ex._observers if type(o).__name__ == "Trial"]
    trial.on_end(ex, False)  # e.g. dispatched as the client left: the exchange ended, then the wait raised
    trial.answered(None)
    (r,) = records(app, tmp_path)
    assert r["complete"] is True
    assert sum(app.path.experiments.counts[r["arm"]].results.values()) == 1


async def test_the_next_turn_after_a_stream_closed_at_done_has_an_idle_gap(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    await send(app, "s", body=sse_usage(10, 5), end=False)  # the client closed at [DONE]
    await send(app, "s", body=sse_usage(10, 5))
    first, second = records(app, tmp_path)
    assert first["complete"] is True and second["idle_gap_s"] is not None


async def test_requests_without_a_session_key_are_not_tracked(tmp_path: Path) -> None:
    app = app_of(config(tmp_path))
    stream = RequestStream(app.path, app.metrics.route_seconds, app.sampling)
    req = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/models"), (":method", "GET")):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = True
    await stream.handle(req)
    stream.close()
    (r,) = records(app, tmp_path)
    assert r["session_source"] == "none" and r["turn"] == 1
    assert len(app.path.experiments.turns) == 0


async def test_a_reload_keeps_the_arms_routers_and_a_log_moved_to_the_same_file_loses_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path, decision_log_queue=50)
    app = app_of(cfg)
    routers = {n: a.router for n, a in app.path.experiments.arms.items()}
    for i in range(30):
        await send(app, f"s{i}", body=sse_usage(10, 5))
    again = config(tmp_path, decision_log_queue=60)  # the same file, a new writer: it waits for the old one
    app.apply(parse_settings(again))
    assert {n: a.router for n, a in app.path.experiments.arms.items()} == routers
    for i in range(30):
        await send(app, f"t{i}", body=sse_usage(10, 5))
    got = records(app, tmp_path)
    names = ("x-session-id",)
    first = [session_of({"x-session-id": f"s{i}"}, RequestFacts(api="chat"), names).id for i in range(30)]
    second = [session_of({"x-session-id": f"t{i}"}, RequestFacts(api="chat"), names).id for i in range(30)]
    assert [r["session"] for r in got] == first + second  # the old writer's records, then the new one's


async def test_a_reload_whose_arm_cannot_apply_to_the_running_settings_keeps_the_running_experiment(
    tmp_path: Path,
) -> None:
    app = app_of(config(tmp_path))
    new = config(tmp_path)
    new["kv_cache_index"] = {"enabled": True, "event_sources": []}  # restart-required: not applied
    new["experiments"]["arms"]["b"] = {"kv_cache_index": {"enabled": True}}  # valid in the file, not against it
    messages = app.apply(parse_settings(new))
    assert any("experiments.arms.b.kv_cache_index.enabled" in m and "kept the running one" in m for m in messages)
    assert app.settings.experiments == parse_settings(config(tmp_path)).experiments
    assert app.path.experiments.arms["b"].settings.selection_strategy == "ConsistentHash"
    await send(app, "still", body=sse_usage(10, 5))
    assert len(records(app, tmp_path)) == 1


async def test_an_arm_with_endpoints_of_its_own_routes_only_to_them(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["experiments"]["arms"] = {"a": {"endpoints": ["a"]}, "b": {"endpoints": ["b", "c"]}}
    app = app_of(cfg)
    for i in range(30):
        await send(app, f"s{i}", body=sse_usage(10, 5))
    got = records(app, tmp_path)
    assert {r["endpoint"] for r in got if r["arm"] == "a"} == {"a"}
    assert {r["endpoint"] for r in got if r["arm"] == "b"} == {"b", "c"}
    assert app.path.experiments.stats()["arms"]["b"]["endpoints"] == ["b", "c"]


def test_an_arms_endpoints_must_be_in_a_static_pool() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"pool": static_pool(2), "experiments": {"enabled": True, "arms": {"x": {"endpoints": ["zz"]}}}})
    assert "experiments.arms.x.endpoints[0]" in [p for p, _ in err.value.problems]
