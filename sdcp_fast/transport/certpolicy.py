"""Who is calling: the one client-certificate policy of both protocols (HTTP/2 runs it after
OpenSSL's verification, which can only refuse more; HTTP/3 as the handshake completes, before
any request is read), and the caller's identity, the single URI SAN of its certificate.

A client certificate is accepted when all of these hold, checked in this order:
  1. it is within its validity period (else EXPIRED: the alert says certificate_expired);
  2. it is not a CA (basicConstraints CA:TRUE): a CA certificate can mint identities;
  3. it has an Authority Key Identifier (RFC 5280 4.2.1.1; cryptography's verifier refuses
     a certificate without one anyway);
  4. cryptography's RFC 5280 client verifier accepts it against the CA file (issuer
     signature, key usage, clientAuth, names), the CA file's certificates the only anchors
     and intermediates: a chain the client sends is not used on either transport;
  5. it names exactly one URI SAN: the caller's identity (../shared/spec/NOTES.md).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError


class CertificateRejected(Exception):
    """A client certificate that must not be accepted; `reason` is one of the class constants."""

    EXPIRED = "expired"  # outside its validity period
    UNTRUSTED = "untrusted"  # no chain to the configured CA, or a policy violation
    NO_IDENTITY = "no-identity"  # zero or several URI SANs
    MISSING = "missing"  # the client sent no certificate

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def uri_identity(cert: x509.Certificate) -> str:
    """The one URI SAN of `cert`; CertificateRejected(NO_IDENTITY) otherwise."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateRejected(CertificateRejected.NO_IDENTITY, "certificate has no SAN") from None
    except ValueError as exc:  # malformed extensions are parsed lazily
        raise CertificateRejected(CertificateRejected.UNTRUSTED, f"bad extensions: {exc}") from exc
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    if len(uris) != 1:
        raise CertificateRejected(
            CertificateRejected.NO_IDENTITY, f"certificate has {len(uris)} URI SANs; exactly one is required"
        )
    return uris[0]


def verify_server(ca_file: str | Path, leaf: x509.Certificate, intermediates: list[x509.Certificate],
                  host: str) -> None:
    """Chain to the CA and a DNS/IP SAN matching `host` (the client's check where OpenSSL is
    not in the loop: HTTP/3)."""
    try:
        subject: x509.DNSName | x509.IPAddress = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        subject = x509.DNSName(host)
    store = Store(x509.load_pem_x509_certificates(Path(ca_file).read_bytes()))
    verifier = PolicyBuilder().store(store).build_server_verifier(subject)
    try:
        verifier.verify(leaf, intermediates)
    except VerificationError as exc:
        raise CertificateRejected(CertificateRejected.UNTRUSTED, f"server {host}: {exc}") from exc


class CertificatePolicy:
    """Checks a client's leaf certificate against the CA file; returns the caller's URI."""

    def __init__(self, ca_file: str | Path):
        self._store = Store(x509.load_pem_x509_certificates(Path(ca_file).read_bytes()))

    def check_der(self, der: bytes) -> str:
        try:
            leaf = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise CertificateRejected(CertificateRejected.UNTRUSTED, f"unparsable certificate: {exc}") from exc
        return self.check(leaf)

    def check(self, leaf: x509.Certificate) -> str:
        now = dt.datetime.now(dt.UTC)
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            raise CertificateRejected(
                CertificateRejected.EXPIRED,
                f"valid {leaf.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ} .. {leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}",
            )
        try:
            constraints = _extension(leaf, x509.BasicConstraints)
            key_id = _extension(leaf, x509.AuthorityKeyIdentifier)
        except ValueError as exc:  # malformed extensions are parsed lazily
            raise CertificateRejected(CertificateRejected.UNTRUSTED, f"bad extensions: {exc}") from exc
        if constraints is not None and constraints.ca:
            raise CertificateRejected(CertificateRejected.UNTRUSTED, "a CA certificate (CA:TRUE) is not a client")
        if key_id is None:
            raise CertificateRejected(CertificateRejected.UNTRUSTED, "no Authority Key Identifier")
        verifier = PolicyBuilder().store(self._store).time(now).build_client_verifier()
        try:
            verifier.verify(leaf, [])
        except VerificationError as exc:
            raise CertificateRejected(CertificateRejected.UNTRUSTED, str(exc)) from exc
        return uri_identity(leaf)


def _extension(cert: x509.Certificate, kind):
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None
