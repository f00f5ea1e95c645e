"""Mutual TLS 1.3 on both protocols: who gets in, with which identity, and who is refused."""

from __future__ import annotations

import cbor2
import httpx
import pytest
import transport_rawtls as rawtls
from aioquic import tls as aioquic_tls
from cryptography.hazmat.primitives import serialization
from transport_support import (
    DRAFTER_URI,
    PROPOSAL,
    PROTOCOLS,
    ROUTER_URI,
    RecordingRouter,
    files,
    h2_post,
    h3_post,
    quic_client_configuration,
    run,
    ssl_client_context,
    wait_for_log,
    x509_load,
)

from sdcp_fast.transport import Client, TransportError, serve

REFUSED = (TransportError, ConnectionError, httpx.TransportError)


async def _refused(protocol, port, pki, config, *, tls12=False):
    """Try one POST with `config`'s certificate (or none); the exception it raised."""
    ca = str(pki.server.ca)
    cert, key = files(config) if config is not None else (None, None)
    with pytest.raises(REFUSED) as info:
        if protocol == "h2":
            await h2_post(port, ssl_client_context(ca, cert, key, tls12=tls12))
        else:
            tweak = None
            if tls12:
                def tweak(context):  # a QUIC client offering only TLS 1.2 (RFC 9001 4.2 forbids it)
                    context._supported_versions = [aioquic_tls.TLS_VERSION_1_2]
            await h3_post(port, quic_client_configuration(ca, cert, key), tweak_tls=tweak)
    return info.value


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_valid_certificate_reaches_handler_with_its_uri(pki, protocol):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server) as server:
            for tls_config, uri in ((pki.drafter, DRAFTER_URI), (pki.router, ROUTER_URI)):
                async with Client(tls_config, protocol, timeout=5.0) as client:
                    response = await client.request(
                        "POST", f"https://127.0.0.1:{server.port}/proposals", PROPOSAL)
                    assert response.status == 200
                    assert response.content_type == "application/sdcp+cbor"
                    assert cbor2.loads(response.body) == {"caller": uri, "echo": cbor2.loads(PROPOSAL)}

    run(main())
    assert [c.caller for c in handler.calls] == [DRAFTER_URI, ROUTER_URI]
    assert [(c.method, c.path, c.content_type, c.body) for c in handler.calls] == [
        ("POST", "/proposals", "application/sdcp+cbor", PROPOSAL)] * 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("case", "h2_log", "h3_log"),
    [
        ("no-certificate", "PEER_DID_NOT_RETURN_A_CERTIFICATE", "missing: no client certificate"),
        ("other-ca", "unable to get local issuer certificate", "untrusted: validation failed"),
        ("expired", "certificate has expired", "expired: valid"),
        ("tls12", "UNSUPPORTED_PROTOCOL", "No supported protocol version"),
        ("two-uri-sans", "has 2 URI SANs", "has 2 URI SANs"),
    ],
)
def test_refused_clients_never_reach_the_handler(pki, transport_logs, protocol, case, h2_log, h3_log):
    config = {"no-certificate": None, "other-ca": pki.foreign, "expired": pki.expired,
              "tls12": pki.drafter, "two-uri-sans": pki.ambiguous}[case]
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server) as server:
            await _refused(protocol, server.port, pki, config, tls12=case == "tls12")
            line = await wait_for_log(transport_logs, h2_log if protocol == "h2" else h3_log)
            assert "refused" in line
            # the server keeps serving: a good client gets through right after
            async with Client(pki.drafter, protocol, timeout=5.0) as client:
                good = await client.request("POST", f"https://127.0.0.1:{server.port}/proposals", PROPOSAL)
            assert good.status == 200

    run(main())
    assert [c.caller for c in handler.calls] == [DRAFTER_URI]  # only the good request


def test_h3_someone_elses_certificate_without_its_key_is_refused(pki, transport_logs):
    """aioquic signs CertificateVerify with the thief's key; the server checks it against the cert."""
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
            error = await _refused("h3", server.port, pki, pki.stolen)
            assert isinstance(error, TransportError) and error.sent is False
            await wait_for_log(transport_logs, "CertificateVerify signature does not match")

    run(main())
    assert handler.calls == []


def test_h2_someone_elses_certificate_without_its_key_is_refused(pki, transport_logs):
    """A raw TLS 1.3 client (OpenSSL would not load a mismatched pair) with a forged CertificateVerify."""
    handler = RecordingRouter()
    drafter_cert = x509_load(pki.drafter.cert)

    def key(path):
        return serialization.load_pem_private_key(path.read_bytes(), None)

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, http3=False) as server:
            args = dict(certificate=drafter_cert, ca_file=str(pki.server.ca))
            # positive control: the same raw client with the right key is accepted
            assert await rawtls.handshake("127.0.0.1", server.port, private_key=key(pki.drafter.key),
                                          **args) == "accepted"
            outcome = await rawtls.handshake("127.0.0.1", server.port, private_key=key(pki.stolen.key),
                                             **args)
            # asyncio's TLS layer drops the connection on a failed handshake, usually before
            # OpenSSL's decrypt_error (51) alert is written; the server log says why.
            assert outcome in ("alert:51", "closed")
            await wait_for_log(transport_logs, "refused TLS from ('127.0.0.1'")
            await wait_for_log(transport_logs, "BAD_SIGNATURE")

    run(main())
    assert handler.calls == []
