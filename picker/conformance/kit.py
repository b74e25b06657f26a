"""``kv-epp conformance``: the flags, the connection to the picker under test (plaintext or TLS, a bearer token),
the run (connect, health, pool, then the cases of each body mode) and the report: one ``PASS|FAIL|SKIP name —
detail`` line per case, or JSON; exit 1 on any FAIL, 2 on a usage error. See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import grpc
from cryptography import x509
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from picker.conformance.cases import Case, Context, Result, connect, health, learn_pool, mode_cases, run_case
from picker.conformance.options import Options, UsageError, add_arguments, options, parse_host_port
from picker.conformance.wire import MODES

# Large enough for the kit's 150 KB body and its echo, bounded like a gateway's ext_proc cluster would be.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def _certificate_names(pem: str) -> list[str]:
    """The DNS and IP names a certificate is valid for (its common name when it has no SAN)."""
    cert = x509.load_pem_x509_certificate(pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        return [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)]


# a connection (and its TLS handshake) may take longer than one case on a busy host: connect waits at least this
CONNECT_TIMEOUT_FLOOR_S = 5.0


async def open_channel(opts: Options) -> grpc.aio.Channel:
    """The channel to the picker: plaintext, or TLS verified against ``--ca`` / the system roots, or (``--insecure``)
    pinned to the certificate the picker shows, with the name checked against one the certificate holds."""
    channel_options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
    if not opts.tls:
        return grpc.aio.insecure_channel(opts.target, options=channel_options)
    host_port = parse_host_port(opts.target)
    assert host_port is not None
    name = opts.sni
    roots = opts.ca
    if opts.insecure:
        try:
            roots = await asyncio.to_thread(ssl.get_server_certificate, host_port, timeout=opts.case_timeout)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--insecure: cannot read {opts.target}'s certificate: {exc}") from None
        names = _certificate_names(roots)
        if name is None and host_port[0] not in names and names:
            name = names[0]  # the certificate is trusted as shown: verify it under a name it holds
    if name is not None:
        channel_options.append(("grpc.ssl_target_name_override", name))
    creds = grpc.ssl_channel_credentials(root_certificates=roots.encode() if roots else None)
    return grpc.aio.secure_channel(opts.target, creds, options=channel_options)


async def run(opts: Options, emit: bool = True) -> list[Result]:
    """Every case in order; each result printed as it comes (``emit``). A picker that cannot be reached fails the
    connect case and skips the rest."""
    metadata = [("authorization", f"Bearer {opts.token}")] if opts.token else []
    channel = await open_channel(opts)
    health_channel = grpc.aio.insecure_channel(opts.health) if opts.health else channel
    results: list[Result] = []

    def report(r: Result) -> None:
        results.append(r)
        if emit:
            print(r.line(), flush=True)

    try:
        reached = await connect(channel, max(opts.case_timeout, CONNECT_TIMEOUT_FLOOR_S))
        report(reached)
        ctx = Context(
            stub=pb_grpc.ExternalProcessorStub(channel), health=health_pb2_grpc.HealthStub(health_channel),
            metadata=metadata, model=opts.model, timeout=opts.case_timeout,
            pool=list(opts.endpoints or ()), pool_given=opts.endpoints is not None,
        )  # fmt: skip

        async def pool(c: Context, notes: list[str]) -> str:
            return await learn_pool(c, notes, MODES[opts.modes[0]])

        plan: list[tuple[str, Case]] = [("health", health), ("pool", pool)]
        for mode in opts.modes:
            plan += [(f"{mode}/{name}", case) for name, case in mode_cases(MODES[mode])]
        for name, case in plan:
            if reached.status != "PASS":
                report(Result(name, "SKIP", "the picker was not reached"))
            else:
                report(await run_case(ctx, name, case))
    finally:
        await channel.close()
        if health_channel is not channel:
            await health_channel.close()
    return results


def main(args: argparse.Namespace) -> int:
    """``kv-epp conformance``: 0 when no case failed, 1 when one did, 2 on a usage error."""
    try:
        opts = options(args)
        results = asyncio.run(run(opts, emit=not args.json))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        return 1
    failed = sum(r.status == "FAIL" for r in results)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    if args.json:
        doc = {"target": opts.target, "passed": failed == 0, "counts": counts, "cases": [asdict(r) for r in results]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        print(f"summary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP — {opts.target}")
    return 1 if failed else 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The flags alone (tests)."""
    p = argparse.ArgumentParser(prog="kv-epp conformance")
    add_arguments(p)
    return p.parse_args(argv)
