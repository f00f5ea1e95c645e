"""Read the ALPN list of a TLS ClientHello, and the alert that refuses it.

An SDCP server over TCP speaks HTTP/2 only, and a client that does not offer "h2" must be
refused with the no_application_protocol alert (RFC 7301 3.2). OpenSSL as Python's ssl
drives it answers such a client without ALPN instead (CPython's ALPN callback returns
"no acknowledgement", never a fatal alert), so the HTTP/2 server reads the ClientHello
first (listener_h2.py peeks at the socket, leaving the bytes for OpenSSL) and refuses it
itself. Parsing is bounded (`MAX_HELLO`) and total: anything odd is `Unparsed`, and then
OpenSSL decides as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

HANDSHAKE_RECORD = 22
CLIENT_HELLO = 1
ALPN_EXTENSION = 16
MAX_HELLO = 1 << 16   # a ClientHello is a few hundred bytes; with post-quantum keys a few KiB
# TLS alert record, plaintext (the server has sent nothing yet): fatal, no_application_protocol
NO_APPLICATION_PROTOCOL_ALERT = bytes([21, 3, 3, 0, 2, 2, 120])


class Incomplete(Exception):
    """More bytes are needed."""


class Unparsed(Exception):
    """Not a ClientHello this module understands: leave it to OpenSSL."""


@dataclass(frozen=True)
class Hello:
    alpn: tuple[bytes, ...] | None   # None: no ALPN extension at all

    def offers(self, protocol: bytes) -> bool:
        return self.alpn is not None and protocol in self.alpn


def parse(data: bytes) -> Hello:
    """The ClientHello at the start of `data`: `Incomplete` or `Unparsed` when not (yet) one."""
    message = _handshake_message(data)
    return Hello(_alpn(message))


def _handshake_message(data: bytes) -> bytes:
    """The first handshake message, reassembled from its records."""
    payload = bytearray()
    pos = 0
    need: int | None = None
    while need is None or len(payload) < need:
        if len(data) < pos + 5:
            raise Incomplete
        kind, length = data[pos], int.from_bytes(data[pos + 3:pos + 5], "big")
        if kind != HANDSHAKE_RECORD or data[pos + 1] != 3 or length == 0 or length > 1 << 14:
            raise Unparsed(f"record type {kind}")
        if len(data) < pos + 5 + length:
            raise Incomplete
        payload += data[pos + 5:pos + 5 + length]
        pos += 5 + length
        if need is None and len(payload) >= 4:
            if payload[0] != CLIENT_HELLO:
                raise Unparsed(f"handshake type {payload[0]}")
            need = 4 + int.from_bytes(payload[1:4], "big")
            if need > MAX_HELLO:
                raise Unparsed("ClientHello too long")
    return bytes(payload[4:need])


def _alpn(body: bytes) -> tuple[bytes, ...] | None:
    reader = _Reader(body)
    reader.skip(2 + 32)                  # legacy_version, random
    reader.skip(reader.uint(1))          # legacy_session_id
    reader.skip(reader.uint(2))          # cipher_suites
    reader.skip(reader.uint(1))          # legacy_compression_methods
    if reader.done():
        return None                      # no extensions at all
    extensions = _Reader(reader.take(reader.uint(2)))
    while not extensions.done():
        kind, data = extensions.uint(2), extensions.take(extensions.uint(2))
        if kind == ALPN_EXTENSION:
            names = _Reader(data)
            listed = _Reader(names.take(names.uint(2)))
            out = []
            while not listed.done():
                out.append(listed.take(listed.uint(1)))
            return tuple(out)
    return None


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise Unparsed("truncated ClientHello")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def skip(self, n: int) -> None:
        self.take(n)

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def done(self) -> bool:
        return self.pos >= len(self.data)
