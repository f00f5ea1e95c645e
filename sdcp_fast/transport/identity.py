"""Who is calling: the URI SAN of a certificate, and why a certificate is refused.

The caller's identity is the single URI SAN of its verified certificate (../shared/spec/NOTES.md,
Identity). A certificate with no URI SAN, or with several, names nobody unambiguously and is
refused. Whether a client certificate is valid at all is certpolicy.py's business (one policy
for both transports); `verify_server` is the client's check of a server where OpenSSL is not
in the loop (HTTP/3).
"""

from __future__ import annotations

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
