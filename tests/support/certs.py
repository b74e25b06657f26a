"""A throwaway certificate authority for TLS tests: a CA, server and client certificates as PEM files."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes
    serial: int


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class TestCA:
    """A self-signed CA that issues leaf certificates naming localhost and 127.0.0.1."""

    __test__ = False  # not a pytest class

    def __init__(self, cn: str = "kv-epp test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, client: bool = False) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        serial = x509.random_serial_number()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key), serial)

    def write_ca(self, path: Path) -> Path:
        path.write_bytes(self.pem)
        return path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` in one step (a new inode), as a Secret volume update does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_pair(issued: Issued, cert_path: Path, key_path: Path) -> None:
    """Key first, then certificate: in between, the files do not match (a rotation caught half-way)."""
    write_atomically(key_path, issued.key_pem)
    write_atomically(cert_path, issued.cert_pem)


def server_certificate(port: int, host: str = "127.0.0.1") -> x509.Certificate:
    """The certificate a new TLS connection to ``host:port`` is shown (not verified)."""
    pem = ssl.get_server_certificate((host, port), timeout=10)
    return x509.load_pem_x509_certificate(pem.encode())


def sha256_hex(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
