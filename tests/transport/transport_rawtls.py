"""A test-only TLS 1.3 client over TCP that can sign CertificateVerify with the wrong key.

OpenSSL (and so Python's ssl and httpx) refuses to load a certificate with a key that does not
match it, so "a client that presents someone else's certificate without its private key" cannot
be built from them. aioquic's sans-IO TLS 1.3 engine has no such check; this module puts the
TLS 1.3 record layer (RFC 8446 5.2, AES-128-GCM only) around it. It is also run with the right
key, as a positive control that the record layer itself works.
"""

from __future__ import annotations

import asyncio
import ssl

from aioquic import tls
from aioquic.buffer import Buffer
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

HANDSHAKE, ALERT, CCS, APPLICATION_DATA = 22, 21, 20, 23


class _RecordKey:
    def __init__(self, secret: bytes):
        self.aead = AESGCM(tls.hkdf_expand_label(hashes.SHA256(), secret, b"key", b"", 16))
        self.iv = tls.hkdf_expand_label(hashes.SHA256(), secret, b"iv", b"", 12)
        self.sequence = 0

    def nonce(self) -> bytes:
        nonce = bytes(a ^ b for a, b in zip(self.iv, self.sequence.to_bytes(12, "big"), strict=True))
        self.sequence += 1
        return nonce


async def handshake(host: str, port: int, *, certificate, private_key, ca_file: str,
                    timeout: float = 5.0) -> str:
    """'accepted' when the server sends application data after our Finished (HTTP/2 SETTINGS),
    'alert:N' when it answers with alert N, 'closed' when it hangs up without either."""
    return await asyncio.wait_for(_handshake(host, port, certificate, private_key, ca_file), timeout)


async def _handshake(host, port, certificate, private_key, ca_file) -> str:
    context = tls.Context(is_client=True, alpn_protocols=["h2"], cafile=ca_file,
                          cipher_suites=[tls.CipherSuite.AES_128_GCM_SHA256],
                          verify_mode=ssl.CERT_REQUIRED)
    context.handshake_extensions = []  # no QUIC transport parameters on TCP
    context.certificate = certificate
    context.certificate_private_key = private_key
    keys: dict[tuple[tls.Direction, tls.Epoch], _RecordKey] = {}
    read_key: list[_RecordKey | None] = [None]

    def on_key(direction, epoch, cipher_suite, secret) -> None:
        keys[(direction, epoch)] = _RecordKey(secret)
        if direction == tls.Direction.DECRYPT:
            read_key[0] = keys[(direction, epoch)]

    context.update_traffic_key_cb = on_key
    reader, writer = await asyncio.open_connection(host, port)
    try:
        buffers = {epoch: Buffer(capacity=65536) for epoch in tls.Epoch}

        def flush() -> None:
            for epoch in (tls.Epoch.INITIAL, tls.Epoch.HANDSHAKE, tls.Epoch.ONE_RTT):
                data = buffers[epoch].data
                if not data:
                    continue
                buffers[epoch] = Buffer(capacity=65536)
                if epoch == tls.Epoch.INITIAL:
                    writer.write(bytes([HANDSHAKE, 3, 1]) + len(data).to_bytes(2, "big") + data)
                    continue
                key = keys[(tls.Direction.ENCRYPT, epoch)]
                inner = data + bytes([HANDSHAKE])
                header = bytes([APPLICATION_DATA, 3, 3]) + (len(inner) + 16).to_bytes(2, "big")
                writer.write(header + key.aead.encrypt(key.nonce(), inner, header))

        context.handle_message(b"", buffers)
        flush()
        while True:
            try:
                header = await reader.readexactly(5)
                body = await reader.readexactly(int.from_bytes(header[3:5], "big"))
            except (asyncio.IncompleteReadError, ConnectionError):
                return "closed"
            kind = header[0]
            if kind == CCS:
                continue
            if kind == ALERT:
                return f"alert:{body[1]}"
            if kind == APPLICATION_DATA:
                key = read_key[0]
                assert key is not None, "encrypted record before ServerHello"
                plain = key.aead.decrypt(key.nonce(), body, header).rstrip(b"\x00")
                kind, body = plain[-1], plain[:-1]
                if kind == ALERT:
                    return f"alert:{body[1]}"
                if kind == APPLICATION_DATA:
                    return "accepted"
            if kind == HANDSHAKE:
                context.handle_message(body, buffers)
                flush()
    finally:
        writer.close()
