"""``kv-epp pd-sidecar``'s flags (picker.pdsidecar.options): the defaults are SidecarOptions', llm-d's names are
accepted, and a sidecar without an allowlist of prefill targets is refused unless protection is turned off."""

from __future__ import annotations

import argparse

import pytest

from picker.pdsidecar.options import DEFAULTS, SidecarOptions, UsageError, add_arguments, options
from picker.runtime.cli import build_parser


def parse(*argv: str) -> SidecarOptions:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return options(p.parse_args(list(argv)))


def test_the_defaults_are_the_contracts() -> None:
    opts = parse("--prefill-targets", "10.0.0.1:8000")
    assert opts == SidecarOptions(prefill_targets=frozenset({"10.0.0.1:8000"}))
    assert (opts.port, opts.model_server_host, opts.model_server_port) == (8000, "127.0.0.1", 8200)
    assert (opts.kv_connector, opts.sglang_bootstrap_port, opts.prefill_failure) == ("nixlv2", 8998, "fail")
    assert opts.metrics_port is None and opts.ssrf_protection
    assert DEFAULTS.max_body_bytes == 16 << 20


def test_the_subcommand_is_wired_into_kv_epp() -> None:
    args = build_parser().parse_args(["pd-sidecar", "--prefill-targets", "10.0.0.1:8000", "--log-level", "debug"])
    assert args.func.__name__ == "_pd_sidecar" and args.log_level == "DEBUG"


def test_llm_d_names_are_accepted() -> None:
    opts = parse("--vllm-port", "8001", "--enable-ssrf-protection=true", "--inference-pool", "my-pool",
                 "--prefiller-use-tls", "--decoder-tls-insecure-skip-verify", "--connector", "shared-storage",
                 "--secure-proxy=false")  # fmt: skip
    assert opts.kv_connector == "shared-storage"
    assert opts.model_server_port == 8001
    assert opts.inference_pool is not None and opts.inference_pool.name == "my-pool"
    assert opts.inference_pool.namespace is None  # the pod's own namespace, found as kubectl finds it
    assert opts.prefiller_use_tls and opts.decoder_tls_insecure_skip_verify
    assert not opts.decoder_use_tls


def test_allowlist_sources() -> None:
    opts = parse("--prefill-targets", " 10.0.0.1:8000, [fd00::0:1]:8000,,10.0.0.1:8000")
    assert opts.prefill_targets == frozenset({"10.0.0.1:8000", "[fd00::1]:8000"})  # canonical, deduplicated
    assert opts.allowlist_source() == "static(2)"
    opts = parse("--inference-pool", "llm/pool", "--kubeconfig", "/k")
    assert opts.inference_pool is not None
    assert (opts.inference_pool.namespace, opts.inference_pool.name, opts.inference_pool.kubeconfig) == (
        "llm",
        "pool",
        "/k",
    )
    assert opts.allowlist_source() == "inference-pool llm/pool"
    opts = parse("--backends-file", "/etc/pool/backends.yaml")
    assert opts.backends_file is not None and opts.allowlist_source() == "file /etc/pool/backends.yaml"
    opts = parse("--ssrf-protection", "off")
    assert not opts.ssrf_protection and opts.allowlist_source() == "off"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ((), "no allowlist of prefill targets"),
        (("--prefill-targets", "10.0.0.1:8000", "--inference-pool", "p"), "give one allowlist source"),
        (("--prefill-targets", " , "), "lists no ip:port"),
        (("--prefill-targets", "prefill:8000"), "is not an IP address"),
        (("--inference-pool", "a/b/c"), "--inference-pool"),
        (("--kubeconfig", "/k", "--prefill-targets", "10.0.0.1:8000"), "--kubeconfig goes with --inference-pool"),
        (("--ssrf-protection", "off", "--backends-file", "b.yaml"), "would not be used"),
        (("--ssrf-protection", "off", "--port", "70000"), "--port 70000"),
        (("--ssrf-protection", "off", "--model-server-port", "0"), "--model-server-port 0"),
        (("--ssrf-protection", "off", "--prefill-timeout", "0"), "--prefill-timeout must be positive"),
        (("--ssrf-protection", "off", "--max-body-bytes", "0"), "--max-body-bytes must be at least 1"),
        (("--ssrf-protection", "off", "--max-buffered-bytes", "0"), "--max-buffered-bytes must be at least 1"),
        (("--ssrf-protection", "off", "--drain-seconds", "-1"), "--drain-seconds"),
        (("--ssrf-protection", "off", "--secure-proxy"), "serves plain HTTP only"),
    ],
)
def test_unusable_flags_are_refused(argv: tuple[str, ...], said: str) -> None:
    with pytest.raises(UsageError, match=said.replace("(", r"\(")):
        parse(*argv)


def test_llm_d_false_for_ssrf_protection_is_not_taken_silently() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        p.parse_args(["--enable-ssrf-protection=false"])
