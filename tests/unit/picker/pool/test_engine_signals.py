"""Engine signals: the strict, bounded text-format parser, the vLLM / SGLang readings, and the scraper against
real HTTP servers (outcomes, the last good value kept until stale then withdrawn, endpoints followed across
reloads, bounded concurrency, one session), plus its config and its place under the picker's supervisor."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from picker.config import ConfigError, EngineMetricsConfig, Settings, parse_settings
from picker.ops.metrics import PickerMetrics
from picker.pool import engine_signals as es
from picker.pool.engine_readings import WANTED_FAMILIES, engine_signals, read_signals
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.exposition import MAX_WANTED_SERIES, Sample, parse_exposition, parse_sample
from picker.pool.pool import Pool
from picker.routing.endpoints import EngineSignals
from picker.runtime.compose import build_server
from picker.runtime.lifecycle import PickerServer
from tests.support.engine_metrics import VLLM_DP2, engines, pool_config
from tests.support.poll import async_wait_until

# SGLang's scheduler gauges (labels model_name, engine_type, tp_rank, pp_rank; dp_rank with DP attention).
SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.43
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 1520.5
"""


def vllm_registry_body(engines: int, running: list[int], waiting: list[int], usage: list[float]) -> str:
    """A body rendered by prometheus_client (what vLLM serves through) with vLLM's names, label names and a
    histogram per engine, so the real formatting (label order, float rendering, _created lines) is read."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    g_run = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r)
    g_wait = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
    g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
    hist = Histogram("vllm:request_queue_time_seconds", "Queue time.", labels, buckets=[0.3, 1.0, 5.0], registry=r)
    for e in range(engines):
        lv = ("m", str(e))
        g_run.labels(*lv).set(running[e])
        g_wait.labels(*lv).set(waiting[e])
        g_kv.labels(*lv).set(usage[e])
        hist.labels(*lv).observe(0.5)
    return generate_latest(r).decode()


# -- the parser -------------------------------------------------------------------------------------------
def test_sample_line_forms() -> None:
    s = parse_sample('m{b="x\\"y\\\\z\\n",a="1"} NaN 1712345678901')
    assert s is not None and s.name == "m" and math.isnan(s.value) and s.timestamp_ms == 1712345678901
    assert s.labels == (("a", "1"), ("b", 'x"y\\z\n'))  # unescaped, sorted by name
    assert parse_sample("m +Inf") == Sample("m", (), math.inf)
    assert parse_sample("m -Inf") == Sample("m", (), -math.inf)
    assert parse_sample("m{} 1.5e-3") == Sample("m", (), 0.0015)
    assert parse_sample('m{a="1",} 2') == Sample("m", (("a", "1"),), 2.0)  # trailing comma is allowed
    assert parse_sample('  m { a = "1" }\t3  ') == Sample("m", (("a", "1"),), 3.0)
    assert parse_sample("ns:sub_name 7") == Sample("ns:sub_name", (), 7.0)


@pytest.mark.parametrize(
    "line",
    [
        "m 1_0",  # Python's float() reads underscores; the format does not
        "m 0x10",
        "m 1e",
        "m --1",
        "m infinity",
        "m",
        'm{a="1"}',
        'm{a="1" 1',
        'm{a="1",a="2"} 1',  # one label twice
        'm{a="\\x"} 1',  # an escape the format does not define
        'm{1a="x"} 1',
        "1m 1",
        "m 1 1.5",  # a timestamp is an integer
        "m 1 2 3",
        'm{a="line\nbreak"} 1',
    ],
)
def test_garbage_sample_lines_are_refused(line: str) -> None:
    assert parse_sample(line) is None


def test_garbage_lines_are_skipped_and_counted_the_rest_is_read() -> None:
    text = (
        "# a free comment is fine\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        "# TYPE vllm:num_requests_running sausage\n"  # not a metric type
        "# HELP\n"  # HELP without a name
        'vllm:num_requests_waiting{engine="0" 3\n'  # unclosed labels
        'vllm:num_requests_waiting{engine="1"} 4\n'
        "\x00\x01\x02 binary\n"
        "\n"
        "vllm:num_requests_running 1\r\n"
    )
    full = parse_exposition(text)
    assert full.skipped == 4 and [s.value for s in full.samples] == [4.0, 1.0]
    assert full.types == {"vllm:num_requests_waiting": "gauge"}
    signals, wanted = read_signals(text)
    assert signals == EngineSignals(waiting=4, running=1, kv_usage=None)
    assert wanted.skipped == 2  # only the wanted families' lines are examined: the bad TYPE and the bad sample


def test_vllm_data_parallel_engines_add_up_and_usage_is_their_mean() -> None:
    signals, expo = read_signals(VLLM_DP2)
    assert expo.skipped == 0
    assert signals == EngineSignals(waiting=2, running=12, kv_usage=0.375)


def test_vllm_body_rendered_by_prometheus_client() -> None:
    body = vllm_registry_body(3, running=[1, 2, 3], waiting=[0, 4, 1], usage=[0.1, 0.2, 0.6])
    signals, expo = read_signals(body)
    assert expo.skipped == 0 and parse_exposition(body).skipped == 0
    assert signals is not None and (signals.waiting, signals.running) == (5, 6)
    assert signals.kv_usage == pytest.approx(0.3)


def test_vllm_before_0_9_reports_usage_under_its_old_name() -> None:
    old = "\n".join(line for line in VLLM_DP2.splitlines() if "vllm:kv_cache_usage_perc" not in line.split(" ")[0])
    assert "vllm:kv_cache_usage_perc{" not in old
    signals, _ = read_signals(old)
    assert signals == EngineSignals(waiting=2, running=12, kv_usage=0.375)


def test_sglang_signals() -> None:
    signals, expo = read_signals(SGLANG)
    assert expo.skipped == 0
    assert signals == EngineSignals(waiting=4, running=12, kv_usage=0.43)


def test_sglang_tensor_parallel_ranks_mirror_one_queue_and_dp_ranks_add_up() -> None:
    lines = []
    for dp, (queue, running, usage) in enumerate([(3, 10, 0.2), (1, 6, 0.4)]):
        for tp in range(4):  # --enable-metrics-for-all-schedulers: every TP rank reports its scheduler's queue
            labels = f'dp_rank="{dp}",engine_type="unified",model_name="m",pp_rank="0",tp_rank="{tp}"'
            lines += [
                f"sglang:num_queue_reqs{{{labels}}} {queue}.0",
                f"sglang:num_running_reqs{{{labels}}} {running}.0",
                f"sglang:token_usage{{{labels}}} {usage}",
            ]
    signals, _ = read_signals("\n".join(lines))
    assert signals is not None and (signals.waiting, signals.running) == (4, 16)
    assert signals.kv_usage == pytest.approx(0.3)


def test_longer_names_and_names_inside_other_lines_are_not_read() -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
        "# HELP other_metric mentions vllm:num_requests_running 5 in its help\n"
        'other_metric{note="vllm:num_requests_waiting 7"} 1\n'
        "vllm:num_requests_waiting 1\n"
        "vllm:num_requests_running 2\n"
    )
    signals, expo = read_signals(text)
    assert signals == EngineSignals(waiting=1, running=2, kv_usage=None)
    assert expo.skipped == 0 and expo.examined == 2


@pytest.mark.parametrize(
    ("waiting", "running", "usage", "expected"),
    [
        ("NaN", "1", "0.5", None),  # a count that is not a number: no reading
        ("2", "-1", "0.5", None),  # a negative count: no reading
        ("+Inf", "1", "0.5", None),
        ("2", "1e12", "0.5", None),  # beyond any engine's queue
        ("2", "1", "NaN", EngineSignals(2, 1, None)),  # a bad usage only drops the usage
        ("2", "1", "1.5", EngineSignals(2, 1, None)),
        ("2", "1", "-0.1", EngineSignals(2, 1, None)),
        ("2.0", "3.0", "0", EngineSignals(2, 3, 0.0)),
    ],
)
def test_values_must_be_plausible(waiting: str, running: str, usage: str, expected: EngineSignals | None) -> None:
    text = (
        f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
        f'vllm:num_requests_running{{engine="0"}} {running}\n'
        f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
    )
    assert read_signals(text)[0] == expected


def test_one_of_waiting_or_running_missing_is_no_reading() -> None:
    assert read_signals("vllm:num_requests_waiting 1\n")[0] is None
    assert read_signals("sglang:num_running_reqs 1\n")[0] is None
    assert read_signals("# nothing here\n")[0] is None
    assert engine_signals(parse_exposition("")) is None


def test_binary_garbage_never_raises() -> None:
    blob = os.urandom(1 << 20)
    text = blob.decode("utf-8", errors="replace")
    signals, _ = read_signals(text)
    assert signals is None
    parse_exposition(text)  # the full parser too: every line examined, none raises
    planted = text + "\nvllm:num_requests_waiting 3\nvllm:num_requests_running 4\n"
    assert read_signals(planted)[0] == EngineSignals(3, 4, None)


def test_a_million_lines_keep_a_bounded_number_of_samples() -> None:
    text = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(3)) + "x 1\n" * 1_000_000
    full = parse_exposition(text)
    assert len(full.samples) == MAX_WANTED_SERIES and full.dropped == 1_000_003 - MAX_WANTED_SERIES
    many = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(200_000))
    wanted = parse_exposition(many + "vllm:num_requests_running 2\n", WANTED_FAMILIES)
    assert len(wanted.samples) == MAX_WANTED_SERIES and wanted.dropped == 200_001 - MAX_WANTED_SERIES


def test_a_huge_body_around_the_wanted_lines() -> None:
    filler = "".join(f'vllm:request_prompt_tokens_bucket{{engine="0",le="{i}"}} {i}.0\n' for i in range(100_000))
    body = filler + VLLM_DP2 + filler
    signals, expo = read_signals(body)
    assert signals == EngineSignals(waiting=2, running=12, kv_usage=0.375)
    assert expo.examined == 16  # HELP, TYPE and two samples of each of the four wanted families there


@pytest.mark.parametrize(
    "line",
    [
        'm{a="b"' + " " * 60_000 + "x",  # whitespace runs between optional parts: no backtracking search
        "m " + "1" * 60_000 + "x",
        "m" + " " * 60_000 + "x",
        "m{" + 'a="b",' * 9_000 + "} 1",  # too many labels
        "# TYPE m" + " " * 60_000 + "x",
        "m " + "9" * 70_000,  # longer than a line may be
    ],
)
def test_pathological_lines_are_refused_in_one_pass(line: str) -> None:
    expo = parse_exposition(line + "\n")
    assert expo.samples == [] and expo.skipped == 1


# -- config -----------------------------------------------------------------------------------------------
def test_config_defaults_and_validation() -> None:
    cfg = Settings().pool.engine_metrics
    assert cfg == EngineMetricsConfig()
    assert (cfg.enabled, cfg.path, cfg.interval_ms, cfg.timeout_ms, cfg.stale_after_ms) == (
        True, "/metrics", 1000, 500, 3000,
    )  # fmt: skip
    bad = [
        ({"timeout_ms": 2000}, "pool.engine_metrics", "timeout_ms may not exceed interval_ms"),
        ({"stale_after_ms": 1500}, "pool.engine_metrics", "stale_after_ms must exceed"),
        ({"path": "metrics"}, "pool.engine_metrics.path", "absolute URL path"),
        ({"path": "/me trics"}, "pool.engine_metrics.path", "absolute URL path"),
        ({"max_bytes": 10}, "pool.engine_metrics.max_bytes", "greater than"),
        ({"max_concurrency": 0}, "pool.engine_metrics.max_concurrency", "greater than"),
        ({"interval": 5}, "pool.engine_metrics.interval", "Extra inputs"),
    ]
    for section, path, message in bad:
        with pytest.raises(ConfigError) as err:
            parse_settings({"pool": {"engine_metrics": section}})
        assert any(p == path and message in m for p, m in err.value.problems), err.value.problems


def engine_of(pool: Pool, name: str) -> EngineSignals | None:
    return pool.view().by_name()[name].engine


def sample_value(metrics: PickerMetrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


async def test_a_good_scrape_reaches_the_snapshot_and_the_gauges() -> None:
    async with engines(1) as [(engine, address)]:
        pool, metrics = Pool(pool_config({"e0": address})), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics, clock=lambda: 1000.0)  # a still clock: ages are exact
        try:
            results = await scraper.scrape_round()
            assert results["e0"].outcome == "ok"
            assert engine_of(pool, "e0") == EngineSignals(waiting=2, running=12, kv_usage=0.375, age_s=0.0)
            assert pool.health_snapshot()[0]["engine"] == {"waiting": 2, "running": 12, "kv_usage": 0.375}
            assert sample_value(metrics, "continuum_engine_scrapes_total", backend="e0", outcome="ok") == 1
            assert sample_value(metrics, "continuum_engine_requests_waiting", backend="e0") == 2
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") == 12
            assert sample_value(metrics, "continuum_engine_kv_cache_usage", backend="e0") == 0.375
            assert sample_value(metrics, "continuum_engine_scrape_age_seconds", backend="e0") == 0.0
            session = scraper._session
            engine.body = vllm_registry_body(1, [3], [1], [0.5])
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(waiting=1, running=3, kv_usage=0.5)
            assert scraper._session is session  # one shared session, connections reused across rounds
        finally:
            await scraper.close()
        assert session is not None and session.closed


async def test_failure_outcomes() -> None:
    async with engines(5) as peers:
        (e404, a404), (ebig, abig), (estream, astream), (ehtml, ahtml), (eredir, aredir) = peers
        e404.status = 404
        ebig.body = VLLM_DP2 + "#" * 10_000  # Content-Length over max_bytes
        estream.stream = 20_000  # no Content-Length: the read stops past max_bytes
        ehtml.body = "<html>metrics moved</html>"
        eredir.status = 302  # never followed
        names = {"e404": a404, "big": abig, "stream": astream, "html": ahtml, "redirect": aredir}
        pool, metrics = Pool(pool_config(names, max_bytes=8192)), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        outcomes = {n: r.outcome for n, r in results.items()}
        assert outcomes == {"e404": "error", "big": "too_large", "stream": "too_large", "html": "unparsed",
                            "redirect": "error"}  # fmt: skip
        assert all(engine_of(pool, n) is None for n in names)
        for name, outcome in outcomes.items():
            assert sample_value(metrics, "continuum_engine_scrapes_total", backend=name, outcome=outcome) == 1
        assert sample_value(metrics, "continuum_engine_requests_waiting", backend="e404") is None


async def test_a_scrape_that_never_answers_times_out() -> None:
    async with engines(1) as [(engine, address)]:
        engine.hang = True
        pool, metrics = Pool(pool_config({"e0": address}, interval_ms=200, timeout_ms=200)), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert results["e0"].outcome == "timeout" and engine_of(pool, "e0") is None
        assert sample_value(metrics, "continuum_engine_scrapes_total", backend="e0", outcome="timeout") == 1


async def test_a_failed_scrape_keeps_the_last_value_until_stale_then_it_is_withdrawn() -> None:
    now = [1000.0]
    async with engines(1) as [(engine, address)]:
        pool, metrics = Pool(pool_config({"e0": address})), PickerMetrics()  # stale after 60 s
        scraper = EngineSignalScraper(pool, metrics, clock=lambda: now[0])
        try:
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, 0.0)
            engine.status = 500
            now[0] += 40.0
            assert (await scraper.scrape_round())["e0"].outcome == "error"
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, age_s=40.0)  # kept, with its age
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") == 12
            now[0] += 20.0
            await scraper.scrape_round()
            assert engine_of(pool, "e0") is None  # 60 s old: withdrawn
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") is None
            assert sample_value(metrics, "continuum_engine_scrape_age_seconds", backend="e0") == 60.0
            engine.status = 200
            now[0] += 1.0
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, 0.0)  # back with the next good scrape
        finally:
            await scraper.close()


async def test_a_reading_is_withdrawn_at_its_deadline_without_another_round() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        # a deadline shorter than the default interval (built without validation): long enough that the round
        # publishes well before it on a busy machine, short enough that no other round runs before it passes
        quick = EngineMetricsConfig.model_construct(**{**pool.cfg.engine_metrics.model_dump(), "stale_after_ms": 2000})
        try:
            await scraper.scrape_round(quick)
            assert engine_of(pool, "e0") is not None
            await async_wait_until(
                lambda: engine_of(pool, "e0") is None, timeout=30, what="the stale reading withdrawn"
            )
            assert engine.hits == 1  # no other round ran: the deadline's timer withdrew it
        finally:
            await scraper.close()


async def test_endpoints_are_followed_across_reloads() -> None:
    async with engines(3) as [(e0, a0), (e1, a1), (e2, a2)]:
        pool, metrics = Pool(pool_config({"e0": a0, "e1": a1})), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            await scraper.scrape_round()
            assert set(scraper.status()) == {"e0", "e1"}
            pool.update(pool_config({"e1": a1, "e2": a2}))  # e0 removed, e2 added
            await scraper.scrape_round()
            assert set(scraper.status()) == {"e1", "e2"}  # state per endpoint of the pool only
            assert (
                engine_of(pool, "e2") is not None
                and sample_value(metrics, "continuum_engine_requests_waiting", backend="e0") is None
            )
            assert e0.hits == 1 and e2.hits == 1
            pool.update(pool_config({"e1": a2, "e2": a1}))  # addresses swapped: nothing carried over
            e1.status = e2.status = 503
            await scraper.scrape_round()
            assert engine_of(pool, "e1") is None and engine_of(pool, "e2") is None
        finally:
            await scraper.close()


async def test_an_endpoint_removed_during_its_scrape_is_not_published() -> None:
    async with engines(2) as [(e0, a0), (_, a1)]:
        pool = Pool(pool_config({"e0": a0, "e1": a1}))
        e0.on_hit = lambda: pool.update(pool_config({"e1": a1}))  # a reload lands while e0 is being scraped
        scraper = EngineSignalScraper(pool)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert set(results) == {"e1"} and set(scraper.status()) == {"e1"}
        assert pool.names() == ("e1",) and engine_of(pool, "e1") is not None


async def test_scrapes_are_concurrent_and_bounded() -> None:
    async with engines(6) as peers:
        shared = {"active": 0, "max": 0}
        for e, _ in peers:
            e.delay = 0.05  # so that scrapes overlap when they may
            e.shared = shared
        pool = Pool(pool_config({f"e{i}": a for i, (_, a) in enumerate(peers)}, max_concurrency=2))
        scraper = EngineSignalScraper(pool)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert [r.outcome for r in results.values()] == ["ok"] * 6
        assert all(e.hits == 1 for e, _ in peers) and shared["max"] <= 2


async def test_run_follows_reloads_of_its_config_and_stops_cleanly() -> None:
    async with engines(1) as [(engine, address)]:
        holder = {"cfg": pool_config({"e0": address}).engine_metrics}
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool, config=lambda: holder["cfg"])
        task = asyncio.create_task(scraper.run())
        try:
            await async_wait_until(lambda: engine_of(pool, "e0") is not None, timeout=30, what="first reading")
            holder["cfg"] = holder["cfg"].model_copy(update={"enabled": False})
            await async_wait_until(lambda: engine_of(pool, "e0") is None, timeout=30, what="withdrawn when off")
            assert scraper.status() == {}
            await async_wait_until(lambda: scraper._session is None, timeout=30, what="session closed when off")
            hits = engine.hits
            holder["cfg"] = holder["cfg"].model_copy(update={"enabled": True})
            await async_wait_until(lambda: engine.hits > hits and engine_of(pool, "e0") is not None, timeout=30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and scraper._session is None


async def test_the_pool_config_is_read_each_round_by_default() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        pool.update(pool_config({"e0": address}, path="/elsewhere"))  # what a hot reload of pool does
        try:
            await scraper.scrape_round()
        finally:
            await scraper.close()
        assert engine.hits == 0 and engine_of(pool, "e0") is not None  # /elsewhere served it


async def test_a_crash_of_the_scraper_is_supervised_readiness_off_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scraper runs under the picker's supervisor (wiring): an exception that escapes it (a bug) is
    counted and turns readiness off, like any background task's."""
    async with engines(1) as [(_, address)]:

        def explode(text: str) -> Any:
            raise RuntimeError("parser bug")

        monkeypatch.setattr(es, "read_signals", explode)
        settings = parse_settings(
            {
                "pool": {"backends": [{"name": "e0", "address": address}]},
                "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
                "admin": {"port": 0},
            }
        )
        server: PickerServer = build_server(settings)
        await server.start()
        try:
            await async_wait_until(lambda: server.not_ready_reason is not None, timeout=30, what="the crash seen")
            assert "EngineSignalScraper.run" in str(server.not_ready_reason) and "parser bug" in str(
                server.not_ready_reason
            )
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r,
            ):
                text = await r.text()
            assert 'continuum_picker_background_task_failures_total{task="EngineSignalScraper.run"} 1.0' in text
        finally:
            await server.stop()


async def test_stop_cancels_a_round_in_flight_and_closes_the_session() -> None:
    async with engines(1) as [(engine, address)]:
        engine.hang = True
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        task = asyncio.create_task(scraper.run())
        await async_wait_until(lambda: engine.active == 1, timeout=30, what="a scrape in flight")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scraper.close()
        assert scraper._session is None and scraper.status()["e0"]["published"] is False
