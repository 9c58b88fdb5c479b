"""TLS at the edge: the frontend's certificate and key, checked before it serves and re-read when they
change (a renewed certificate, as cert-manager writes one into the Secret a pod mounts).

`check_pair` is the one check both use: the files exist, the certificate is valid now (not expired, not
yet-to-come), and the key is the certificate's. uvicorn makes the server's `ssl.SSLContext` from the same
files; a reload loads the new pair into that context, so new connections get the new certificate and open
ones keep theirs. A pair that fails the check is not loaded: the one in force stays.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509


class TLSConfigError(ValueError):
    """A certificate/key pair that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class CertificateInfo:
    subject: str
    not_after: datetime.datetime  # UTC
    serial: int


def check_pair(cert_path: str, key_path: str, now: datetime.datetime | None = None) -> CertificateInfo:
    """The certificate of a usable (certificate chain, key) pair; raises TLSConfigError."""
    if not cert_path or not key_path:
        raise TLSConfigError("--tls-cert and --tls-key go together: give both, or neither for plain HTTP")
    try:
        pem = Path(cert_path).read_bytes()
    except OSError as err:
        raise TLSConfigError(f"TLS certificate {cert_path}: {err.strerror or err}") from None
    try:
        cert = x509.load_pem_x509_certificate(pem)  # the leaf: the first certificate of the chain
    except ValueError as err:
        raise TLSConfigError(f"TLS certificate {cert_path}: not a PEM certificate ({err})") from None
    at = now or datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc <= at:
        raise TLSConfigError(f"TLS certificate {cert_path} expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} "
                             "UTC; renew it")
    if cert.not_valid_before_utc > at:
        raise TLSConfigError(f"TLS certificate {cert_path} is not valid before "
                             f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC (check the clock)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except FileNotFoundError as err:
        raise TLSConfigError(f"TLS key {key_path}: {err.strerror}") from None
    except (ssl.SSLError, OSError) as err:
        raise TLSConfigError(f"TLS key {key_path} does not go with certificate {cert_path} or cannot be read "
                             f"({getattr(err, 'reason', None) or err})") from None
    return CertificateInfo(cert.subject.rfc4514_string(), cert.not_valid_after_utc, cert.serial_number)


def reload_pair(ctx: ssl.SSLContext, cert_path: str, key_path: str) -> CertificateInfo:
    """Checks the pair and loads it into the serving context; raises TLSConfigError (nothing loaded)."""
    info = check_pair(cert_path, key_path)
    ctx.load_cert_chain(cert_path, key_path)
    return info
