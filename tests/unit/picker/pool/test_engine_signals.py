"""Engine signals: the strict, bounded text-format parser, the vLLM / SGLang readings, and the scraper against
real HTTP servers (outcomes, the last good value kept until stale then withdrawn, endpoints followed across
reloads, bounded concurrency, one session), plus its config and its place under the picker's supervisor.

The tests that start a server or bind a socket: tests/integration/test_engine_signals_http.py."""

from __future__ import annotations

import math
import os

import pytest

from picker.config import ConfigError, EngineMetricsConfig, Settings, parse_settings
from picker.pool.engine_readings import WANTED_FAMILIES, engine_signals, read_signals
from picker.pool.exposition import MAX_WANTED_SERIES, Sample, parse_exposition, parse_sample
from picker.routing.endpoints import EngineSignals
from tests.support.engine_metrics import VLLM_DP2, vllm_registry_body

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
