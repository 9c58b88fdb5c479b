"""Certificates for TLS tests, made with `cryptography`: a CA, and server certificates it signs for
127.0.0.1 with any validity window (expired and not-yet-valid ones included)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: str  # the CA certificate's PEM file (what clients trust)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(directory: Path, name: str = "pdserve-test-ca") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(key, cert, str(path))


def new_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return key


def issue(ca: Authority, key: ec.EllipticCurvePrivateKey, path: Path, valid_from_h: float = -1.0,
          valid_for_h: float = 24.0) -> int:
    """Writes a certificate for 127.0.0.1 and localhost, valid from `valid_from_h` hours from now for
    `valid_for_h` hours, signed by `ca`, to `path` (its chain: the leaf, then the CA); returns its serial."""
    start = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=valid_from_h)
    serial = x509.random_serial_number()
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(serial)
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(hours=valid_for_h))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + ca.cert.public_bytes(serialization.Encoding.PEM))
    return serial
