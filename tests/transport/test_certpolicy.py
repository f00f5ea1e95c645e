"""One certificate policy on both transports: every client-certificate case of an independent
mutual-TLS run is tried on HTTP/2 and on HTTP/3 and must get the same answer; and a TLS
client that offers no h2 (h3) is refused with no_application_protocol."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from pathlib import Path

import httpx
import pytest
import transport_rawtls as rawtls
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from transport_support import (
    DRAFTER_URI,
    ROUTER_URI,
    h2_post,
    h3_post,
    quic_client_configuration,
    run,
    ssl_client_context,
)

from sdcp_fast.transport import Authorizer, Router, TLSConfig, TransportError, serve
from sdcp_fast.transport.certs import load_ca, make_instance_cert, write_pair

REFUSED = (TransportError, ConnectionError, httpx.TransportError, ssl.SSLError, TimeoutError)


def _variant(ca, uri=DRAFTER_URI, *, drop=(), replace=None, extra=(), self_signed=False,
             not_before=None, not_after=None, uris=None):
    """An instance certificate of `ca` with extensions dropped, replaced or added."""
    template, key = make_instance_cert(ca, uri)
    replace = replace or {}
    now = dt.datetime.now(dt.UTC)
    subject = template.subject
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(subject if self_signed else template.issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before or now - dt.timedelta(minutes=5))
               .not_valid_after(not_after or now + dt.timedelta(days=30)))
    for extension in template.extensions:
        kind = type(extension.value)
        if kind in drop:
            continue
        value = replace.get(kind, extension.value)
        if kind is x509.SubjectAlternativeName and uris is not None:
            others = [n for n in value if not isinstance(n, x509.UniformResourceIdentifier)]
            value = x509.SubjectAlternativeName([*others, *map(x509.UniformResourceIdentifier, uris)])
        if self_signed and kind is x509.AuthorityKeyIdentifier:
            value = x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key())
        builder = builder.add_extension(value, extension.critical)
    for value, critical in extra:
        builder = builder.add_extension(value, critical)
    return builder.sign(key if self_signed else ca.key, hashes.SHA256()), key


CASES = {
    # name: (how to make it, HTTP status when it gets through, or "refused")
    "valid": (lambda ca: make_instance_cert(ca, DRAFTER_URI), 200),
    "no-certificate": (None, "refused"),
    "another-ca": (lambda ca: make_instance_cert(_other_ca(), DRAFTER_URI), "refused"),
    "self-signed": (lambda ca: _variant(ca, self_signed=True), "refused"),
    "expired": (lambda ca: _variant(ca, not_before=_days(-30), not_after=_days(-1)), "refused"),
    "not-yet-valid": (lambda ca: _variant(ca, not_before=_days(1), not_after=_days(30)), "refused"),
    "no-uri-san": (lambda ca: _variant(ca, uris=[]), "refused"),
    "two-uri-sans": (lambda ca: _variant(ca, uris=[DRAFTER_URI, "https://other.example/"]), "refused"),
    "server-only-eku": (lambda ca: _variant(ca, replace={x509.ExtendedKeyUsage: x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])}), "refused"),
    "ca-true-leaf": (lambda ca: _variant(ca, replace={x509.BasicConstraints: x509.BasicConstraints(
        ca=True, path_length=None)}), "refused"),
    "no-authority-key-id": (lambda ca: _variant(ca, drop=(x509.AuthorityKeyIdentifier,)), "refused"),
    "wrong-role": (lambda ca: make_instance_cert(ca, ROUTER_URI), 403),   # routers may not propose
}


def _days(n: int) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(days=n)


def _other_ca():
    from sdcp_fast.transport.certs import make_ca

    return make_ca("another CA")


class ProposalsOnly:
    """POST /proposals for drafters only: the wrong-role case gets 403 from the Authorizer."""

    def __init__(self) -> None:
        self.router = Router(authorizer=Authorizer({"proposals": {DRAFTER_URI}}))
        self.router.add("POST", "/proposals", self._ok, resource="proposals")

    async def _ok(self, request):
        from sdcp_fast.transport import Response

        return Response(204, b"", None) if request.caller == DRAFTER_URI else Response(500)

    async def handle(self, request):
        return await self.router.handle(request)


@pytest.fixture(scope="module")
def case_files(pki, tmp_path_factory) -> dict[str, TLSConfig | None]:
    ca = load_ca(pki.root)
    root = tmp_path_factory.mktemp("cases")
    out: dict[str, TLSConfig | None] = {}
    for name, (make, _) in CASES.items():
        if make is None:
            out[name] = None
            continue
        cert, key = make(ca)
        write_pair(cert, key, root / f"{name}.pem", root / f"{name}.key")
        out[name] = TLSConfig(root / f"{name}.pem", root / f"{name}.key", pki.server.ca)
    return out


async def _answer(protocol: str, port: int, ca: Path, config: TLSConfig | None):
    cert, key = (str(config.cert), str(config.key)) if config is not None else (None, None)
    try:
        if protocol == "h2":
            response = await h2_post(port, ssl_client_context(str(ca), cert, key))
            return response.status_code
        response = await h3_post(port, quic_client_configuration(str(ca), cert, key))
        return response.status
    except REFUSED:
        return "refused"


def test_every_certificate_case_gets_the_same_answer_on_both_transports(pki, case_files):
    answers: dict[str, dict[str, object]] = {}

    async def main():
        async with await serve(ProposalsOnly(), host="127.0.0.1", port=0, tls=pki.server) as server:
            for name in CASES:
                answers[name] = {p: await _answer(p, server.port, pki.server.ca, case_files[name])
                                 for p in ("h2", "h3")}
            # a certificate with another key: OpenSSL will not load such a pair, so raw TLS on
            # HTTP/2 and aioquic (which does not check the pair) on HTTP/3
            stolen = rawtls.handshake("127.0.0.1", server.port, certificate=_cert(pki.drafter.cert),
                                      private_key=_key(pki.stolen.key), ca_file=str(pki.server.ca))
            h2_stolen = await stolen
            h3_stolen = await _answer("h3", server.port, pki.server.ca, pki.stolen)
            answers["another-key"] = {"h2": "refused" if h2_stolen != "accepted" else 204, "h3": h3_stolen}
            refused = server.refusals.counts
            assert refused["certificate"] + refused["tls"] >= 2 * (len(CASES) - 2)

    run(main(), timeout=60)
    expected = {name: {"h2": want, "h3": want} for name, (_, want) in CASES.items()}
    expected["valid"] = {"h2": 204, "h3": 204}
    expected["another-key"] = {"h2": "refused", "h3": "refused"}
    assert answers == expected


def _cert(path: Path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _key(path: Path):
    return serialization.load_pem_private_key(path.read_bytes(), None)


@pytest.mark.parametrize("offer", [["http/1.1"], None], ids=["http1.1-only", "no-alpn"])
def test_h2_client_offering_no_h2_is_refused_with_no_application_protocol(pki, offer):
    """Before: a client offering only http/1.1 was answered on HTTP/2."""

    async def main():
        async with await serve(ProposalsOnly(), host="127.0.0.1", port=0, tls=pki.server, http3=False) as server:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(cafile=pki.server.ca)
            context.load_cert_chain(pki.drafter.cert, pki.drafter.key)
            if offer is not None:
                context.set_alpn_protocols(offer)
            with pytest.raises(ssl.SSLError, match="alert no application protocol"):
                await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
            assert server.refusals.counts["alpn"] == 1
            good = await h2_post(server.port, ssl_client_context(str(pki.server.ca), str(pki.drafter.cert),
                                                                str(pki.drafter.key)))
            assert good.status_code == 204

    run(main())


def test_h3_client_offering_no_h3_is_refused_with_no_application_protocol(pki):
    from aioquic.tls import AlertDescription

    async def main():
        async with await serve(ProposalsOnly(), host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
            config: QuicConfiguration = quic_client_configuration(str(pki.server.ca), str(pki.drafter.cert),
                                                                  str(pki.drafter.key))
            config.alpn_protocols = ["hq-interop"]
            with pytest.raises(REFUSED):
                await h3_post(server.port, config)
            assert server.refusals.counts["tls"] == 1

    run(main())
    assert AlertDescription.no_application_protocol == 120


def test_policy_refusal_reasons(pki, case_files):
    """What the policy says, on its own (both transports log it)."""
    from sdcp_fast.transport.certpolicy import CertificatePolicy, CertificateRejected

    policy = CertificatePolicy(pki.server.ca)
    assert policy.check(_cert(case_files["valid"].cert)) == DRAFTER_URI
    reasons = {}
    for name in ("expired", "ca-true-leaf", "no-authority-key-id", "server-only-eku", "two-uri-sans"):
        with pytest.raises(CertificateRejected) as info:
            policy.check(_cert(case_files[name].cert))
        reasons[name] = info.value.reason
    assert reasons == {"expired": "expired", "ca-true-leaf": "untrusted", "no-authority-key-id": "untrusted",
                       "server-only-eku": "untrusted", "two-uri-sans": "no-identity"}

