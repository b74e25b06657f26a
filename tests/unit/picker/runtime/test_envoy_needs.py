"""``kv-epp envoy-config --picker-config FILE`` derives what the picker's config needs of Envoy, refuses a flag
that would silently disable one of its features (exit 2, one line naming the flag and the config key), and the
picker says which response mode its response cache needs (start log, ``/readyz``) and what its streams showed.

The tests that start a server or bind a socket: tests/integration/test_envoy_needs_http.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config import parse_settings
from picker.request.exchange import Exchange
from picker.runtime import cli as picker_cli
from picker.runtime.envoy_needs import (
    FULL_MODE_COST,
    Given,
    Refused,
    derive,
    response_cache_detail,
    response_cache_log_fields,
)
from tests.support.builders import route, static_pool
from tests.support.response_cache import OK, make, req, respond

POOL = static_pool(2)
TOKEN = "s3cret-token"


def settings(**sections: Any) -> Any:
    return parse_settings({"pool": POOL, **sections})


def envoy_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, config: dict[str, Any], *flags: str
) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``kv-epp envoy-config --picker-config`` on ``config``: exit code, the bootstrap (parsed) and stderr."""
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump({"pool": POOL, **config}))
    rc = picker_cli.main(["envoy-config", "--picker-config", str(path), *flags])
    out = capsys.readouterr()
    return rc, (yaml.safe_load(out.out) if rc == 0 else None), out.err


def ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (f,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    config: dict[str, Any] = f["typed_config"]
    return config


def picker_cluster(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kv_epp_picker"]
    return c


# -- the response mode --------------------------------------------------------------------------------------
def test_the_response_cache_derives_full_and_says_what_it_costs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, boot, err = envoy_config(capsys, tmp_path, {"response_cache": {"enabled": True}})
    assert rc == 0 and boot is not None
    mode = ext_proc(boot)["processing_mode"]
    assert mode["response_body_mode"] == "FULL_DUPLEX_STREAMED" and mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: response mode full: response_cache.enabled"), err
    assert FULL_MODE_COST in lines[0] and "every response body chunk passes through the picker" in lines[0]
    # BUFFERED bodies: full too (STREAMED response bodies), and the cheaper sampled mode is named
    rc, boot, err = envoy_config(capsys, tmp_path, {"response_cache": {"enabled": True}}, "--body-mode", "BUFFERED")
    assert rc == 0 and boot is not None and ext_proc(boot)["processing_mode"]["response_body_mode"] == "STREAMED"
    assert "--response-mode sampled also stores every miss" in err
    # explicit modes that store every miss are kept, and nothing is said
    rc, boot, err = envoy_config(capsys, tmp_path, {"response_cache": {"enabled": True}}, "--response-mode", "full")
    assert rc == 0 and err == ""
    rc, boot, err = envoy_config(
        capsys, tmp_path, {"response_cache": {"enabled": True}}, "--response-mode", "sampled", "--body-mode", "BUFFERED"
    )
    assert rc == 0 and boot is not None and ext_proc(boot)["allow_mode_override"] is True and err == ""


def test_without_the_cache_nothing_changes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, boot, err = envoy_config(capsys, tmp_path, {"response_cache": {"enabled": False}})
    assert rc == 0 and boot is not None and err == ""
    assert ext_proc(boot)["processing_mode"]["response_body_mode"] == "NONE"
    assert ext_proc(boot)["message_timeout"] == "5.000s"
    assert picker_cluster(boot)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9002}
    }


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--response-mode", "none"], ["--response-mode none", "response_cache.enabled"]),
        (
            ["--response-mode", "sampled", "--body-mode", "FULL_DUPLEX_STREAMED"],
            ["--response-mode sampled", "--body-mode FULL_DUPLEX_STREAMED", "response_cache.enabled"],
        ),
    ],
    ids=["none", "sampled-full-duplex"],
)
def test_a_response_mode_that_stores_nothing_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], names: list[str]
) -> None:
    rc, boot, err = envoy_config(capsys, tmp_path, {"response_cache": {"enabled": True}}, *flags)
    assert rc == 2 and boot is None
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(n in lines[0] for n in names), lines[0]
    assert str(tmp_path / "picker.yaml") in lines[0]  # which config turns the cache on


def test_sampled_takes_buffered_bodies_when_no_body_mode_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    """With or without a picker config: the only body mode in which Envoy honours the sample's mode override."""
    assert picker_cli.main(["envoy-config", "--backend", "10.0.0.1:8000", "--response-mode", "sampled"]) == 0
    out = capsys.readouterr()
    boot = yaml.safe_load(out.out)
    assert ext_proc(boot)["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert "note: body mode BUFFERED" in out.err
    argv = ["envoy-config", "--backend", "10.0.0.1:8000", "--response-mode", "sampled", "--body-mode"]
    assert picker_cli.main([*argv, "FULL_DUPLEX_STREAMED"]) == 2
    assert "--response-mode sampled needs --body-mode BUFFERED" in capsys.readouterr().err


def test_response_sampling_asked_for_in_the_file_derives_sampled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = {"extproc": {"response_sample_rate": 0.2}}
    rc, boot, err = envoy_config(capsys, tmp_path, config)
    assert rc == 0 and boot is not None
    assert ext_proc(boot)["allow_mode_override"] is True
    assert ext_proc(boot)["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert "note: response mode sampled" in err and "note: body mode BUFFERED" in err
    rc, _, err = envoy_config(capsys, tmp_path, config, "--response-mode", "none")
    assert rc == 2 and "--response-mode none" in err and "extproc.response_sample_rate" in err
    rc, _, err = envoy_config(capsys, tmp_path, config, "--body-mode", "FULL_DUPLEX_STREAMED")
    assert rc == 2 and "--body-mode BUFFERED" in err and "extproc.response_sample_rate" in err
    rc, boot, err = envoy_config(capsys, tmp_path, config, "--response-mode", "full")  # reads every response
    assert rc == 0 and err == ""
    # the defaults alone (or a rate of 0) ask for nothing
    rc, boot, err = envoy_config(capsys, tmp_path, {"extproc": {"response_sample_rate": 0.0}})
    assert rc == 0 and boot is not None and err == "" and "allow_mode_override" not in ext_proc(boot)


def test_derive_is_pure_over_settings_and_flags() -> None:
    s = settings(response_cache={"enabled": True})
    d = derive(s, Given())
    assert (d.options["response_mode"], d.options["body_mode"]) == ("full", "FULL_DUPLEX_STREAMED")
    assert d.options["picker_address"] == "127.0.0.1:9002" and d.warnings == []
    assert derive(None, Given()).options["response_mode"] == "none"  # no picker config: today's default
    assert derive(s, Given(mode="no-picker")).options["response_mode"] == "none"  # no picker at all
    with pytest.raises(Refused, match="--response-mode none"):
        derive(s, Given(response_mode="none"))


# -- the picker's address, TLS, token --------------------------------------------------------------------------
def test_the_sidecar_reaches_the_picker_where_its_config_listens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    auth = {"token_file": str(token_file)}  # every interface: the port needs client authentication
    rc, boot, err = envoy_config(capsys, tmp_path, {"extproc": {"host": "0.0.0.0", "port": 9102, "auth": auth}})
    assert rc == 0 and boot is not None and "note: picker address 127.0.0.1:9102" in err
    address = picker_cluster(boot)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address == {"socket_address": {"address": "127.0.0.1", "port_value": 9102}}
    rc, boot, err = envoy_config(capsys, tmp_path, {"extproc": {"port": 9102}}, "--picker", "127.0.0.1:7000")
    assert rc == 0 and err == ""  # an explicit --picker wins
    rc, _, err = envoy_config(capsys, tmp_path, {"extproc": {"port": 0}})
    assert rc == 2 and "extproc.port is 0" in err and "--picker HOST:PORT" in err
    v6 = settings(extproc={"host": "::", "port": 9002, "auth": auth})
    assert derive(v6, Given()).options["picker_address"] == "[::1]:9002"
    assert derive(settings(extproc={"host": "::1", "port": 9002}), Given()).options["picker_address"] == "[::1]:9002"


def test_tls_follows_the_picker_and_a_contrary_flag_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plaintext = {"extproc": {"host": "127.0.0.1", "tls": {"mode": "plaintext"}}}
    rc, boot, err = envoy_config(capsys, tmp_path, plaintext)
    assert rc == 0 and boot is not None and "transport_socket" not in picker_cluster(boot)
    assert "note: plaintext to the picker: extproc.tls.mode is plaintext" in err
    rc, _, err = envoy_config(capsys, tmp_path, plaintext, "--picker-sni", "kv-epp")
    assert rc == 2 and "--picker-sni" in err and "extproc.tls.mode" in err
    rc, _, err = envoy_config(capsys, tmp_path, {}, "--picker-plaintext")
    assert rc == 2 and err.startswith("error: --picker-plaintext") and "extproc.tls.mode is tls" in err
    ca = tmp_path / "ca.pem"
    ca.write_text("unused")
    rc, _, err = envoy_config(capsys, tmp_path, {"extproc": {"tls": {"client_ca_file": str(ca)}}})
    assert rc == 2 and "extproc.tls.client_ca_file" in err and "--picker-client-cert" in err


def test_the_token_comes_from_the_pickers_token_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = {"extproc": {"auth": {"token_file": str(token_file)}}}
    rc, boot, err = envoy_config(capsys, tmp_path, config)
    assert rc == 0 and boot is not None
    assert ext_proc(boot)["grpc_service"]["initial_metadata"] == [{"key": "authorization", "value": f"Bearer {TOKEN}"}]
    assert "extproc.auth.token_file" in err and TOKEN not in err
    other = tmp_path / "other"
    other.write_text("another-token")
    rc, _, err = envoy_config(capsys, tmp_path, config, "--picker-token-file", str(other))
    assert rc == 2 and "--picker-token-file" in err and "extproc.auth.token_file" in err and "another" not in err
    rc, _, err = envoy_config(capsys, tmp_path, config, "--picker-token-file", str(token_file))
    assert rc == 0
    missing = {"extproc": {"auth": {"token_file": str(tmp_path / "absent")}}}
    rc, _, err = envoy_config(capsys, tmp_path, missing)
    assert rc == 2 and "extproc.auth.token_file" in err and "--picker-token-file" in err
    rc, _, err = envoy_config(capsys, tmp_path, missing, "--picker-token-file", str(token_file))
    assert rc == 0  # the picker's file lives elsewhere (its pod): the flag gives the token


# -- timeouts, retries, buffers ---------------------------------------------------------------------------------
def test_the_semantic_cache_gets_a_message_timeout_above_its_embedding_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    semantic = {"enabled": True, "backend": "http://127.0.0.1:1", "embedding_model": "e", "embedding_timeout_ms": 8000}
    config = {"response_cache": {"enabled": True, "semantic": semantic}}
    rc, boot, err = envoy_config(capsys, tmp_path, config)
    assert rc == 0 and boot is not None and ext_proc(boot)["message_timeout"] == "9.000s"
    assert "note: ext_proc message timeout 9000 ms" in err
    rc, boot, err = envoy_config(capsys, tmp_path, config, "--message-timeout-ms", "3000")
    assert rc == 0 and boot is not None and ext_proc(boot)["message_timeout"] == "3.000s"
    assert "warning: --message-timeout-ms 3000" in err


def test_retries_cover_the_pickers_fallbacks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, boot, err = envoy_config(capsys, tmp_path, {"pool": {**POOL, "fallbacks": 4}})
    assert rc == 0 and boot is not None and "note: retries 4" in err
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["retry_policy"]["num_retries"] == 4
    rc, _, err = envoy_config(capsys, tmp_path, {"pool": {**POOL, "fallbacks": 4}}, "--retries", "1")
    assert rc == 0 and "warning: --retries 1 is below pool.fallbacks (4)" in err
    assert derive(settings(pool={**POOL, "fallbacks": 0}), Given()).options["retries"] == 2  # never fewer


def test_buffered_bodies_fit_envoys_buffer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    big = {"extproc": {"max_body_bytes": 32 << 20}, "admission": {"max_buffered_body_bytes": 64 << 20}}
    rc, boot, err = envoy_config(capsys, tmp_path, big, "--body-mode", "BUFFERED")
    assert rc == 0 and boot is not None and "note: Envoy's buffer limit" in err
    assert boot["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == (32 << 20) + (1 << 20)


# -- the picker's side: start log and /readyz ---------------------------------------------------------------------
def detail_of(app: Any) -> dict[str, object] | None:
    return response_cache_detail(app.settings, app.response_cache.miss_bodies, app.response_cache.stored)


async def test_readyz_names_the_mode_the_cache_needs_and_what_reached_the_picker() -> None:
    app, cache, _ = make()
    detail = detail_of(app)
    assert detail is not None and detail["needs_response_mode"] == "full"
    assert detail["envoy_sends_response_bodies"] is None  # no eligible miss has ended yet
    assert response_cache_log_fields(app.settings) == "response_cache=on needs_response_mode=full"
    # response mode none: the miss's headers, then the stream closes (completed), no body
    ex = await route(app, req(temperature=0, user="none"))
    assert isinstance(ex, Exchange)
    ex.cache.headers = ((":status", "200"), ("content-type", "application/json"))
    ex.response_headers(200)
    ex.end(completed=True)
    detail = detail_of(app)
    assert detail is not None and detail["envoy_sends_response_bodies"] is False and "problem" in detail
    assert detail["eligible_miss_bodies"] == {"reached": 0, "missing": 1}
    # response mode full: the body reaches the picker
    ex = await route(app, req(temperature=0, user="full"))
    assert isinstance(ex, Exchange)
    respond(ex, [OK])
    await cache.flush()
    detail = detail_of(app)
    assert detail is not None and detail["envoy_sends_response_bodies"] == "some" and detail["stored"] == 1
    # a cut response tells nothing
    ex = await route(app, req(temperature=0, user="cut"))
    assert isinstance(ex, Exchange)
    ex.response_headers(200)
    ex.end(completed=False)
    assert cache.miss_bodies == {"reached": 1, "missing": 1}


def test_without_the_cache_readyz_says_nothing_of_it() -> None:
    off = settings(response_cache={"enabled": False})
    assert response_cache_detail(off, {"reached": 3, "missing": 0}, 0) is None
    assert response_cache_log_fields(off) == "response_cache=off"
    on = settings(response_cache={"enabled": True})
    detail = response_cache_detail(on, {"reached": 3, "missing": 0}, 2)
    assert detail is not None and detail["envoy_sends_response_bodies"] is True and "problem" not in detail
