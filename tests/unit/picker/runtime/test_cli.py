"""The two commands' shared shape: global flags before or after the subcommand, one `config validate FILE`
(warnings, then `ok: FILE`; or one `error: <path>: <message>` line per problem and exit 2), and a pointer to
the other program's check when given the other program's file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from listener import cli as listener_cli
from listener.config import ListenerConfig
from picker.config import Settings
from picker.runtime import cli as picker_cli

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
Main = Callable[[list[str]], int]

PICKER_PLACEMENTS = [
    (["serve"], "INFO"),
    (["--log-level", "debug", "serve"], "DEBUG"),
    (["serve", "--log-level", "DEBUG"], "DEBUG"),
    (["serve", "--config", "x.yaml", "--log-level", "warning"], "WARNING"),
    (["--log-level", "ERROR", "serve", "--log-level", "DEBUG"], "DEBUG"),  # the later one wins
    (["config", "validate", "x.yaml", "--log-level", "ERROR"], "ERROR"),
    (["config", "--log-level", "ERROR", "validate", "x.yaml"], "ERROR"),
    (["--log-level", "ERROR", "config", "validate", "x.yaml"], "ERROR"),
    (["envoy-config", "--backend", "127.0.0.1:8000", "--log-level", "CRITICAL"], "CRITICAL"),
]
LISTENER_PLACEMENTS = [
    (["run", "--config", "x.yaml"], "INFO"),
    (["--log-level", "debug", "run", "--config", "x.yaml"], "DEBUG"),
    (["run", "--config", "x.yaml", "--log-level", "DEBUG"], "DEBUG"),
    (["run", "--log-level", "WARNING", "--config", "x.yaml"], "WARNING"),
    (["config", "validate", "x.yaml", "--log-level", "ERROR"], "ERROR"),
    (["--log-level", "ERROR", "check", "--config", "x.yaml"], "ERROR"),
]


@pytest.mark.parametrize(("argv", "level"), PICKER_PLACEMENTS)
def test_kv_epp_takes_log_level_before_or_after_the_subcommand(argv: list[str], level: str) -> None:
    assert picker_cli.build_parser().parse_args(argv).log_level == level


@pytest.mark.parametrize(("argv", "level"), LISTENER_PLACEMENTS)
def test_kv_listener_takes_log_level_before_or_after_the_subcommand(argv: list[str], level: str) -> None:
    assert listener_cli.build_parser().parse_args(argv).log_level == level


@pytest.mark.parametrize("main", [picker_cli.main, listener_cli.main])
@pytest.mark.parametrize("where", ["before", "after"])
def test_an_unknown_log_level_is_a_usage_error(
    main: Main, where: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["config", "validate", str(tmp_path / "c.yaml")]
    argv = ["--log-level", "LOUD", *argv] if where == "before" else [*argv, "--log-level", "LOUD"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_the_real_entry_points_accept_the_flag_after_the_subcommand() -> None:
    """The console scripts as processes (python -m), the flag after the subcommand: `ok: FILE`, exit 0."""
    for module, example in (("picker", "picker.yaml"), ("listener.cli", "listener.yaml")):
        f = str(EXAMPLES / example)
        r = subprocess.run(
            [sys.executable, "-m", module, "config", "validate", f, "--log-level", "DEBUG"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (r.returncode, r.stdout, r.stderr) == (0, f"ok: {f}\n", ""), module


# -- config validate: one shape for both programs ------------------------------------------------------

PICKER_BAD = "prefix_routing:\n  virtual_nodes: -1\nbogus: 1\n"
LISTENER_BAD = "sources:\n  - backend_name: 'bad name!'\n    model: m\n    zmq_endpoint: tcp://x:1\n    bogus: 1\n"


@pytest.mark.parametrize(
    ("main", "bad", "paths"),
    [
        (picker_cli.main, PICKER_BAD, ["prefix_routing.virtual_nodes", "bogus"]),
        (listener_cli.main, LISTENER_BAD, ["sources[0].backend_name", "sources[0].bogus"]),
    ],
)
def test_validate_prints_one_error_line_per_problem_and_exits_2(
    main: Main, bad: str, paths: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(bad)
    assert main(["config", "validate", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert sorted(line.split(": ")[1] for line in lines) == sorted(paths), err
    assert all(line.startswith("error: ") and len(line.split(": ")) >= 3 for line in lines), err


def test_validate_prints_warnings_then_ok(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("selection_strategy: PrefixAwareHash\n")  # prefix routing off: a warning
    assert picker_cli.main(["config", "validate", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"ok: {f}"
    assert lines[:-1] and all(line.startswith("warning: ") for line in lines[:-1]), lines


@pytest.mark.parametrize(
    ("main", "example"),
    [(picker_cli.main, "picker.yaml"), (picker_cli.main, "picker-kv-aware.yaml"), (listener_cli.main, "listener.yaml")],
)
def test_validate_accepts_the_examples(main: Main, example: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = str(EXAMPLES / example)
    assert main(["config", "validate", f]) == 0
    assert capsys.readouterr() == (f"ok: {f}\n", "")


def test_listener_check_is_an_alias_of_config_validate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good, bad = str(EXAMPLES / "listener.yaml"), tmp_path / "bad.yaml"
    bad.write_text(LISTENER_BAD)
    for f in (good, str(bad)):
        rc = listener_cli.main(["config", "validate", f])
        first = capsys.readouterr()
        assert listener_cli.main(["check", "--config", f]) == rc
        assert capsys.readouterr() == first
    assert "alias of `config validate FILE`" in listener_cli.build_parser().format_help()


@pytest.mark.parametrize(
    ("main", "example", "other"),
    [
        (picker_cli.main, "listener.yaml", "kv-listener"),
        (listener_cli.main, "picker.yaml", "kv-epp"),
        (listener_cli.main, "picker-kv-aware.yaml", "kv-epp"),
    ],
)
def test_the_other_programs_file_points_at_its_check(
    main: Main, example: str, other: str, capsys: pytest.CaptureFixture[str]
) -> None:
    f = str(EXAMPLES / example)
    assert main(["config", "validate", f]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {f}: this is a {other} config ("), err
    assert f"check it with `{other} config validate {f}`" in err
    assert "Extra inputs" not in err


def test_a_file_of_neither_program_gets_the_plain_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "other.yaml"
    f.write_text("apiVersion: v1\nkind: ConfigMap\n")
    for main in (picker_cli.main, listener_cli.main):
        assert main(["config", "validate", str(f)]) == 2
        err = capsys.readouterr().err
        assert "error: apiVersion: " in err and "config validate" not in err


def test_the_recognised_keys_are_the_other_programs_settings() -> None:
    """Each command recognises the other's file by top-level keys it names itself (the listener may not
    import the picker's config): every one must be a setting of the other program and none of its own."""
    picker_keys, listener_keys = set(Settings.model_fields), set(ListenerConfig.model_fields)
    assert picker_keys >= listener_cli.PICKER_KEYS and not listener_cli.PICKER_KEYS & listener_keys
    assert listener_keys >= picker_cli.LISTENER_KEYS and not picker_cli.LISTENER_KEYS & picker_keys


def test_envoy_config_takes_the_pool_as_a_headless_service(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--pool-dns NAME --pool-port P...: a STRICT_DNS cluster (the chart's Envoy); exclusive with listed backends,
    and the way out for a picker config whose pool is discovered (its members are not in the file)."""
    argv = ["envoy-config", "--pool-dns", "kv-epp-pool.ns.svc.cluster.local", "--pool-port", "8000"]
    assert picker_cli.main([*argv, "--pool-port", "8001", "--stats-port", "9902"]) == 0
    out = capsys.readouterr().out
    assert "envoy.cluster.dns" in out and "kv-epp-pool.ns.svc.cluster.local" in out and "8001" in out and "9902" in out
    discovered = tmp_path / "picker.yaml"
    discovered.write_text("pool: {inference_pool: {name: llama-pool, namespace: ns}}\n")
    assert picker_cli.main(["envoy-config", "--picker-config", str(discovered)]) == 2
    assert "give --pool-dns NAME --pool-port PORT" in capsys.readouterr().err
    assert picker_cli.main(["envoy-config", "--picker-config", str(discovered), *argv[1:]]) == 0
    capsys.readouterr()
    for bad, message in [
        ([*argv, "--backend", "10.0.0.1:8000"], "--pool-dns replaces --backend"),
        (["envoy-config", "--backend", "10.0.0.1:8000", "--pool-port", "8000"], "--pool-port goes with --pool-dns"),
        (["envoy-config", "--pool-dns", "kv-epp-pool"], "pool_dns needs pool_ports"),
    ]:
        assert picker_cli.main(bad) == 2, bad
        assert message in capsys.readouterr().err


def test_envoy_config_takes_several_pickers(capsys: pytest.CaptureFixture[str]) -> None:
    """--picker repeated: one ext_proc cluster with every picker as a host (docs/scale-out.md)."""
    argv = ["envoy-config", "--mode", "standalone", "--backend", "10.1.0.1:8000"]
    assert picker_cli.main([*argv, "--picker", "10.0.0.1:9002", "--picker", "10.0.0.2:9002"]) == 0
    out = capsys.readouterr().out
    assert "address: 10.0.0.1" in out and "address: 10.0.0.2" in out and "LEAST_REQUEST" in out
    assert picker_cli.main([*argv, "--picker", "10.0.0.1:9002"]) == 0
    out = capsys.readouterr().out
    assert "10.0.0.2" not in out and "LEAST_REQUEST" not in out
