"""HTTP/2's listener: TCP connections until their TLS 1.3 handshake is done.

`TCPListener` accepts; `TLSAcceptor` peeks at the ClientHello and refuses a client that
offers no "h2" with no_application_protocol (RFC 7301 3.2; OpenSSL as Python's ssl drives it
would answer without ALPN instead), then runs the handshake under `handshake_timeout`, at
most `max_handshakes` at once (past that the oldest is dropped), and hands the connection to
`server_h2.H2ServerProtocol`. Parsing the ClientHello is bounded (`MAX_HELLO`) and total:
anything odd is `Unparsed`, and OpenSSL decides as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Any

from .lifecycle import Serving
from .refusals import Kind, log

PEEK_RETRY_S = 0.005     # a ClientHello split over several TCP segments: look again this soon

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


def offered_alpn(data: bytes) -> tuple[bytes, ...] | None:
    """The ALPN protocols the ClientHello at the start of `data` offers (None: no ALPN
    extension); `Incomplete` or `Unparsed` when it is not (yet) a ClientHello."""
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
    reader = _Reader(bytes(payload[4:need]))
    reader.take(2 + 32)                  # legacy_version, random
    reader.take(reader.uint(1))          # legacy_session_id
    reader.take(reader.uint(2))          # cipher_suites
    reader.take(reader.uint(1))          # legacy_compression_methods
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

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def done(self) -> bool:
        return self.pos >= len(self.data)


class TCPListener:
    """The listening socket: each accepted connection goes to a `TLSAcceptor` as a bare socket
    (not `loop.create_server`: on uvloop a transport reads the ClientHello before a peek could)."""

    def __init__(self, serving: Serving, sock: socket.socket, make_protocol: Callable[[Serving, Any], Any]):
        self._serving = serving
        self._make_protocol = make_protocol
        self.sockets = [sock]
        sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._run(sock), name="h2-accept")

    async def _run(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listening)
            except OSError as exc:   # out of descriptors, say: let it pass, then go on
                log.warning("h2: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            TLSAcceptor(self._serving, sock, peer, self._make_protocol).start()

    def close(self) -> None:
        self._task.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class TLSAcceptor:
    """One accepted TCP socket until the TLS 1.3 handshake with a client certificate completes."""

    def __init__(self, serving: Serving, sock: socket.socket, peer: Any, make_protocol: Callable[[Serving, Any], Any]):
        """`make_protocol(serving, peer)`: the protocol that takes the connection once the
        handshake is done, through its `start(transport)`."""
        self._serving = serving
        self._make_protocol = make_protocol
        self._sock: socket.socket | None = sock   # ours until a transport owns it
        self._transport: asyncio.BaseTransport | None = None
        self._peer = peer
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        host = self._peer[0] if isinstance(self._peer, tuple) else str(self._peer)
        if not self._serving.may_connect(host):
            self._serving.refusals.refuse(Kind.CONNECTION_RATE, self._peer, "h2: new connections too fast")
            self._close_socket()
            return
        self._serving.handshake_started(self, self._drop, self._peer)
        self._task = self._serving.spawn(self._accept())

    def _drop(self) -> None:
        """Over max_handshakes, this (the oldest) handshake makes room."""
        if self._task is not None:
            self._task.cancel()
        self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept(self) -> None:
        serving, peer, sock = self._serving, self._peer, self._sock
        if sock is None:
            return
        tls_transport = None
        try:
            async with asyncio.timeout(serving.limits.handshake_timeout):
                if not await self._offers_h2(sock):
                    return
                protocol = self._make_protocol(serving, peer)
                self._sock = None   # the transport owns it from here (and closes it on failure)
                tls_transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                    lambda: protocol, sock, ssl=serving.ssl_context,
                    ssl_handshake_timeout=serving.limits.handshake_timeout)
        except TimeoutError:
            serving.refusals.refuse(Kind.HANDSHAKE_TIMEOUT, peer,
                                    f"TLS not done within {serving.limits.handshake_timeout}s")
            return
        except (ssl.SSLError, OSError, ConnectionError) as exc:
            serving.refusals.refuse(Kind.TLS, peer, f"h2: refused TLS from {peer}: {_reason(exc)}")
            return
        finally:
            serving.handshake_ended(self)
            self._close_socket()   # still ours: refused, timed out or dropped before the handshake
        protocol.start(tls_transport)

    async def _offers_h2(self, sock: socket.socket) -> bool:
        """Peek at the ClientHello (the bytes stay for OpenSSL); refuse one without "h2"."""
        try:
            alpn, size = await _peek_client_hello(sock)
        except (Unparsed, OSError):
            return True  # not ours to judge: OpenSSL refuses what is not TLS 1.3
        if alpn is not None and b"h2" in alpn:
            return True
        offered = "no ALPN" if alpn is None else f"ALPN {[p.decode('latin-1') for p in alpn]}"
        self._serving.refusals.refuse(Kind.ALPN, self._peer, f"h2 not offered ({offered}): no_application_protocol")
        with contextlib.suppress(OSError):
            sock.recv(size)   # read, so that the close is a FIN after the alert, not a reset
            sock.send(NO_APPLICATION_PROTOCOL_ALERT)   # 7 bytes: fits any send buffer
            sock.shutdown(socket.SHUT_WR)
        return False


async def _peek_client_hello(sock: socket.socket) -> tuple[tuple[bytes, ...] | None, int]:
    """The ALPN list of the ClientHello waiting on the socket, read with MSG_PEEK so that
    OpenSSL still reads it (no transport reads the socket yet); with the bytes it spans."""
    loop = asyncio.get_running_loop()
    while True:
        readable = loop.create_future()
        fd = sock.fileno()   # the number stays ours to unregister if the socket is closed meanwhile
        loop.add_reader(fd, _set_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            data = sock.recv(MAX_HELLO, socket.MSG_PEEK)
        except BlockingIOError:
            continue   # woken with nothing to read
        if not data:
            raise ConnectionResetError("closed before the ClientHello")
        try:
            return offered_alpn(data), len(data)
        except Incomplete:
            if len(data) >= MAX_HELLO:
                raise Unparsed("ClientHello too long") from None
            # the socket stays readable while the peeked bytes sit there: wait a little
            # for the rest instead of spinning (bounded by handshake_timeout)
            await asyncio.sleep(PEEK_RETRY_S)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.reason}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return f"{type(exc).__name__}: {exc}"
