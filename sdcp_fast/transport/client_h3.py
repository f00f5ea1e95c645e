"""HTTP/3 client on h3.py: one QUIC connection per origin, our certificate presented, the
server's checked (its chain by aioquic, its host name by certpolicy.verify_server)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aioquic.h3.connection import ErrorCode
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from .certpolicy import CertificateRejected, verify_server
from .client_base import (
    DEFAULT_MAX_RESPONSE,
    ClientConnection,
    ClientResponse,
    Origins,
    TransportError,
    request_headers,
)
from .compat import peer_certificates
from .h3 import Data, H3Error, H3Streams, Headers, QuicDriver

CRYPTO_ERROR_RANGE = range(0x100, 0x200)  # QUIC CRYPTO_ERROR + TLS alert (RFC 9001 4.8)
MAX_ANSWER_FIELDS = 1 << 16   # the field-section size our client advertises for answers


class H3ClientConnection(asyncio.DatagramProtocol, QuicDriver, ClientConnection):
    """One QUIC connection to a server (its socket connected to it once `connected_to` is
    set), requests as streams, answers to their futures; ready once the handshake is done."""

    def __init__(self, quic: QuicConnection, max_response: int = DEFAULT_MAX_RESPONSE):
        QuicDriver.__init__(self, quic, self._sendto)
        ClientConnection.__init__(self, max_response)
        self._h3: H3Streams | None = None
        self._datagram_transport: asyncio.DatagramTransport | None = None
        self.connected_to = None
        self.has_room = True   # QUIC's stream limit and flow control pace the streams

    def connection_made(self, transport) -> None:
        self._datagram_transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.receive(data, addr)

    def _sendto(self, data: bytes, addr) -> None:
        # once connected, no address: no route look-up per send
        self._datagram_transport.sendto(data, None if self.connected_to is not None else addr)

    def connect(self, addr) -> None:
        self.quic.connect(addr, now=self._loop.time())
        self.transmit()

    async def wait_connected(self) -> None:
        await asyncio.shield(self._ready)

    async def request(self, method: str, authority: str, target: str, body: bytes | None,
                      content_type: str | None) -> ClientResponse:
        """One exchange; the caller bounds it (Client's attempt does, connecting included)."""
        if self._closed is not None:
            raise TransportError(str(self._closed), sent=False)
        stream_id = self.quic.get_next_available_stream_id()
        exchange = self._exchange(stream_id)
        self._h3.send(stream_id, request_headers(method, authority, target, body, content_type), body or b"")
        if len(self._exchanges) == 1:
            self.transmit()
        else:   # with the other requests of this turn
            self.transmit_soon()
        try:
            return await exchange.future
        except asyncio.CancelledError:   # the caller's deadline or shutdown: tell the server
            self._cancel(stream_id)
            raise
        finally:
            self._exchanges.pop(stream_id, None)
            self.last_used = self._loop.time()

    def _cancel(self, stream_id: int) -> None:
        if self._closed is not None:   # nothing left to tell the server
            return
        with contextlib.suppress(Exception):
            self.quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self.quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()

    def quic_event(self, event) -> None:
        if isinstance(event, events.StreamDataReceived):
            if self._h3 is not None:
                self._on_stream_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.StreamReset):
            exchange = self._exchanges.get(event.stream_id)
            if exchange is not None:
                sent = event.error_code != ErrorCode.H3_REQUEST_REJECTED  # rejected: unprocessed
                exchange.fail(TransportError(f"stream reset by server ({event.error_code:#x})", sent=sent))
        elif isinstance(event, events.HandshakeCompleted):
            self._h3 = H3Streams(self.quic, is_client=True, max_field_section_size=MAX_ANSWER_FIELDS)
            if not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(event, events.ConnectionTerminated):
            # A TLS alert (a transport close, frame_type set) means the handshake or the
            # certificate was refused: no request was processed. Application closes (H3
            # codes) carry no frame type.
            refused = event.frame_type is not None and event.error_code in CRYPTO_ERROR_RANGE
            error = TransportError(
                f"HTTP/3 connection closed ({event.error_code:#x}: {event.reason_phrase})", sent=not refused)
            self._fail_all(error, ConnectionError(str(error)))
            self.stop_timer()

    def _on_stream_data(self, stream_id: int, data: bytes, ended: bool) -> None:
        exchange = self._exchanges.get(stream_id)
        try:
            events = self._h3.receive(stream_id, data, ended)
        except H3Error as exc:
            self.quic.close(error_code=exc.code, reason_phrase=str(exc))
            self.transmit()
            return
        if exchange is None or exchange.future.done():
            return
        for h3_event in events:
            if h3_event.__class__ is Headers:
                exchange.head(h3_event.headers)
            elif h3_event.__class__ is Data:
                if not exchange.add(h3_event.data):
                    self._cancel(stream_id)
                    return
            else:
                continue
            if h3_event.ended:
                exchange.finish()
                return

    def close(self) -> None:
        """CONNECTION_CLOSE (unless the connection is over already), then the socket."""
        if self._closed is None:
            self.quic.close()
            self.transmit()
        self.stop_timer()   # nothing may be sent once the socket is closed
        if self._datagram_transport is not None:
            self._datagram_transport.close()

    retire = close


class H3Origins(Origins):
    """The HTTP/3 connections of one client, one per origin (QUIC flow control paces streams)."""

    async def _open(self, origin: tuple[str, int], freed: asyncio.Event) -> H3ClientConnection:
        """A QUIC connection with its handshake done (TLS 1.3, our certificate presented)."""
        (host, port), timeout, loop = origin, self._connect_timeout, asyncio.get_running_loop()
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the caller's
        # cancellation when its inner await finishes at the same moment (gh-86296)
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        connection = QuicConnection(configuration=self._tls.quic_configuration(
            is_client=True, idle_timeout=self._idle_timeout))
        # a socket connected to the server: each datagram is sent without an address (no route
        # lookup per send), and the kernel delivers only the server's datagrams to it
        _, protocol = await loop.create_datagram_endpoint(
            lambda: H3ClientConnection(connection, self._max_response), family=family, remote_addr=addr)
        protocol.connected_to = addr
        protocol.connect(addr)
        try:
            async with asyncio.timeout(timeout):
                await protocol.wait_connected()
            leaf, chain = peer_certificates(connection)
            if leaf is None:
                raise CertificateRejected(CertificateRejected.MISSING, "server sent no certificate")
            verify_server(self._tls.ca, leaf, chain, host)
        except CertificateRejected as exc:
            protocol.close()
            raise TransportError(f"refusing server {host}:{port}: {exc}", sent=False) from exc
        except BaseException:
            protocol.close()   # the caller's deadline too: do not leak the socket
            raise
        return protocol
