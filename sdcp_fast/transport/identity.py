"""Who is calling: verify a client certificate chain and read its URI SAN.

The caller's identity is the single URI SAN of its verified certificate (../shared/spec/NOTES.md, Identity).
A certificate with no URI SAN, or with several, names nobody unambiguously and is refused.
HTTP/2 relies on OpenSSL for the chain check and reads the identity here; HTTP/3 has no
OpenSSL in the loop, so `ClientCertificateVerifier` checks the chain with cryptography's
RFC 5280 client verifier (validity dates, issuer signature, basic constraints, key usage and
the clientAuth extended key usage) against the configured CA.
"""

from __future__ import annotations

import datetime as dt
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
        self.detail = detail


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


def uri_identity_der(der: bytes) -> str:
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise CertificateRejected(CertificateRejected.UNTRUSTED, f"unparsable certificate: {exc}") from exc
    return uri_identity(cert)


class ClientCertificateVerifier:
    """Checks a client chain against the CA file and returns the caller's URI."""

    def __init__(self, ca_file: str | Path):
        self._store = Store(x509.load_pem_x509_certificates(Path(ca_file).read_bytes()))

    def verify(self, leaf: x509.Certificate, intermediates: list[x509.Certificate]) -> str:
        now = dt.datetime.now(dt.UTC)
        # Checked first and on its own so that the alert says "expired", not a generic failure.
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            raise CertificateRejected(
                CertificateRejected.EXPIRED,
                f"valid {leaf.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ} .. {leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}",
            )
        verifier = PolicyBuilder().store(self._store).time(now).build_client_verifier()
        try:
            verifier.verify(leaf, intermediates)
        except VerificationError as exc:
            raise CertificateRejected(CertificateRejected.UNTRUSTED, str(exc)) from exc
        return uri_identity(leaf)


def verify_server(ca_file: str | Path, leaf: x509.Certificate, intermediates: list[x509.Certificate],
                  host: str) -> None:
    """Chain to the CA and a DNS/IP SAN matching `host` (used where OpenSSL is not in the loop)."""
    import ipaddress

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
