"""The one client-certificate policy, applied identically on HTTP/2 and HTTP/3.

HTTP/2 runs OpenSSL's verification during the handshake (chain to the CA, validity, the
client's CertificateVerify) and then this policy on the leaf before the connection is used;
HTTP/3 has aioquic check the client's CertificateVerify in the handshake and runs this policy
as the handshake completes, before any request is read (server_h3.py). So what decides whether a certificate is valid is this module on both transports,
and OpenSSL on HTTP/2 can only refuse more, never admit more (tests/transport/test_certpolicy.py
runs every case on both and asserts the same answer).

A client certificate is accepted when all of these hold, checked in this order:
  1. it is within its validity period (else EXPIRED: the alert says certificate_expired);
  2. it is not a CA (basicConstraints CA:TRUE): a CA certificate can mint identities;
  3. it has an Authority Key Identifier (RFC 5280 4.2.1.1: a CA MUST put one in every
     certificate it issues; our `sdcp-fast certs` always does). Refused on both
     transports, because cryptography's RFC 5280 verifier refuses it anyway, and a missing
     AKI means a certificate made outside any conforming CA tooling;
  4. cryptography's RFC 5280 client verifier accepts it against the CA file: issuer
     signature, key usage, the clientAuth extended key usage, names. Only the CA file's
     certificates are trust anchors and intermediates: a chain the client sends is not
     used, on either transport (Python's ssl cannot hand that chain over on HTTP/2), so a
     deployment with an intermediate CA puts it in the CA file;
  5. it names exactly one URI SAN: the caller's identity (../shared/spec/NOTES.md).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from .identity import CertificateRejected, uri_identity


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
