"""HTTP/3 client adapter on aioquic (QuicConnectionProtocol + H3Connection): one QUIC
connection per origin, kept and reused, our certificate presented, the server's checked."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

from aioquic.h3.connection import ErrorCode
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from .client_base import (
    ANNOUNCE_LENGTH_FROM,
    ClientResponse,
    RequestTimeout,
    TransportError,
    split_https_url,
)
from .identity import CertificateRejected, verify_server
from .quic_lean import LeanAcks, LeanH3
from .quic_mtls import check_aioquic, peer_certificates
from .tlsconfig import TLSConfig

CRYPTO_ERROR_RANGE = range(0x100, 0x200)  # QUIC CRYPTO_ERROR + TLS alert (RFC 9001 4.8)
REMEMBERED_HEADS = 256   # request header lists kept per connection (forgotten all at once when full)


class _Exchange:
    """One request's stream: its answer as it arrives (slots: one is made per request)."""

    __slots__ = ("future", "max_response", "status", "headers", "body")

    def __init__(self, future: asyncio.Future[ClientResponse], max_response: int):
        self.future = future
        self.max_response = max_response
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()


def _read_head(exchange: _Exchange, headers) -> None:
    """The answer's status and fields (names lowercased) into `exchange`."""
    for name, value in headers:
        if name == b":status":
            exchange.status = int(value)
        elif not name.startswith(b":"):
            exchange.headers[name.decode("latin-1").lower()] = value.decode("latin-1")


class H3ClientConnection(LeanAcks):
    def __init__(self, quic: QuicConnection, **kwargs):
        super().__init__(quic, **kwargs)
        self._h3 = LeanH3(quic)
        self._exchanges: dict[int, _Exchange] = {}
        self._terminated: TransportError | None = None
        self._datagram_transport: asyncio.DatagramTransport | None = None
        # request header lists by (method, authority, target, content type): a session's
        # proposals all go to one URL with the same fields
        self._heads: dict[tuple, list[tuple[bytes, bytes]]] = {}

    @property
    def usable(self) -> bool:
        return self._terminated is None

    async def request(self, method: str, authority: str, target: str, body: bytes | None,
                      content_type: str | None, timeout: float | None, max_response: int) -> ClientResponse:
        """One exchange within `timeout` seconds; None: the caller bounds it (Client's attempt
        does, under one asyncio.timeout for connecting and the exchange: a second one here
        would cost a timer armed and cancelled per request)."""
        if self._terminated is not None:
            raise TransportError(str(self._terminated), sent=False)
        stream_id = self._quic.get_next_available_stream_id()
        key = (method, authority, target, content_type if body is not None else None)
        headers = self._heads.get(key)
        if headers is None:
            headers = [(b":method", method.encode()), (b":scheme", b"https"),
                       (b":authority", authority.encode()), (b":path", target.encode())]
            if content_type and body is not None:
                headers.append((b"content-type", content_type.encode()))
            if len(self._heads) >= REMEMBERED_HEADS:
                self._heads.clear()
            self._heads[key] = headers
        if body is not None and len(body) >= ANNOUNCE_LENGTH_FROM:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        exchange = _Exchange(self._loop.create_future(), max_response)   # the protocol's loop (no getpid())
        self._exchanges[stream_id] = exchange
        if body:
            self._h3.send_message(stream_id, headers, body)
        else:
            self._h3.send_headers(stream_id, headers, end_stream=True)
        self.transmit_data(alone=len(self._exchanges) == 1)   # with the other requests of this turn
        try:
            # the future is awaited directly (wait_for and shield would each add a loop turn)
            if timeout is None:
                return await exchange.future
            async with asyncio.timeout(timeout):
                return await exchange.future
        except TimeoutError:
            self._cancel(stream_id)
            raise RequestTimeout(f"no answer to {method} {target} within {timeout}s", sent=True) from None
        except asyncio.CancelledError:   # the caller's deadline or shutdown: tell the server
            self._cancel(stream_id)
            raise
        finally:
            self._exchanges.pop(stream_id, None)

    def _cancel(self, stream_id: int) -> None:
        if self._terminated is not None:   # nothing left to tell the server
            return
        with contextlib.suppress(Exception):
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            # A TLS alert (a transport close, frame_type set) means the handshake was refused:
            # no request was processed. Application closes (H3 codes 0x100..) carry no frame type.
            refused = event.frame_type is not None and event.error_code in CRYPTO_ERROR_RANGE
            self._terminated = TransportError(
                f"HTTP/3 connection closed ({event.error_code:#x}: {event.reason_phrase})", sent=not refused
            )
            for exchange in self._exchanges.values():
                if not exchange.future.done():
                    exchange.future.set_exception(self._terminated)
            return
        if isinstance(event, StreamReset):
            exchange = self._exchanges.get(event.stream_id)
            if exchange is not None and not exchange.future.done():
                sent = event.error_code != ErrorCode.H3_REQUEST_REJECTED  # rejected: unprocessed
                exchange.future.set_exception(
                    TransportError(f"stream reset by server ({event.error_code:#x})", sent=sent)
                )
        h3_events = self._h3.handle_event(event)
        if len(h3_events) == 2:
            head, data = h3_events
            if head.__class__ is HeadersReceived and data.__class__ is DataReceived and data.stream_ended \
                    and head.stream_id == data.stream_id and not head.stream_ended:
                # a whole answer (as every SDCP answer comes): settled at once
                exchange = self._exchanges.get(head.stream_id)
                if exchange is not None and not exchange.future.done() and not exchange.body \
                        and len(data.data) <= exchange.max_response:
                    _read_head(exchange, head.headers)
                    exchange.future.set_result(ClientResponse(exchange.status, exchange.headers, data.data))
                    return
        for h3_event in h3_events:
            exchange = self._exchanges.get(getattr(h3_event, "stream_id", -1))
            if exchange is None or exchange.future.done():
                continue
            if isinstance(h3_event, HeadersReceived):
                _read_head(exchange, h3_event.headers)
            elif isinstance(h3_event, DataReceived):
                exchange.body += h3_event.data
                if len(exchange.body) > exchange.max_response:
                    self._cancel(h3_event.stream_id)
                    exchange.future.set_exception(
                        TransportError(f"response over {exchange.max_response} bytes", sent=True))
                    continue
            if getattr(h3_event, "stream_ended", False) and not exchange.future.done():
                exchange.future.set_result(
                    ClientResponse(exchange.status, exchange.headers, bytes(exchange.body)))

    async def aclose(self) -> None:
        self.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):   # not wait_for: see connect_h3
                await self.wait_closed()
        if self._datagram_transport is not None:
            self._datagram_transport.close()


async def connect_h3(host: str, port: int, configuration: QuicConfiguration,
                     timeout: float, *, ca_file: str | Path) -> H3ClientConnection:
    """Open a QUIC connection and finish its handshake (TLS 1.3, our certificate presented)."""
    check_aioquic()  # peer_certificates() reads aioquic internals
    loop = asyncio.get_running_loop()
    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the caller's
    # cancellation when its inner await finishes at the same moment (gh-86296), and then the
    # attempt's deadline (Client._attempt, the only one over a request) would be lost
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, TimeoutError) as exc:
        raise TransportError(f"cannot resolve {host}: {exc}", sent=False) from exc
    family, _, _, _, addr = infos[0]
    connection = QuicConnection(configuration=configuration)
    # a socket connected to the server: each datagram is sent without an address (no route
    # lookup per send), and the kernel delivers only the server's datagrams to it
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: H3ClientConnection(connection), family=family, remote_addr=addr,
    )
    assert isinstance(protocol, H3ClientConnection)
    protocol._datagram_transport = transport
    protocol._connected_to = addr
    protocol.connect(addr)
    try:
        async with asyncio.timeout(timeout):
            await protocol.wait_connected()
    except (ConnectionError, TimeoutError) as exc:
        protocol.close()
        transport.close()
        raise TransportError(f"QUIC handshake with {host}:{port} failed: {exc or 'timeout'}", sent=False) from exc
    except asyncio.CancelledError:  # the caller's overall deadline: do not leak the socket
        protocol.close()
        transport.close()
        raise
    protocol.lengthen_ack_delay()
    leaf, chain = peer_certificates(connection)
    try:
        if leaf is None:
            raise CertificateRejected(CertificateRejected.MISSING, "server sent no certificate")
        verify_server(ca_file, leaf, chain, host)
    except CertificateRejected as exc:
        await protocol.aclose()
        raise TransportError(f"refusing server {host}:{port}: {exc}", sent=False) from exc
    return protocol


class H3Origins:
    """The HTTP/3 connections of one client, one per origin."""

    def __init__(self, tls: TLSConfig, *, connect_timeout: float, idle_timeout: float, max_response: int):
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._max_response = max_response
        self._connections: dict[tuple[str, int], H3ClientConnection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def open(self, url: str) -> tuple[H3ClientConnection, str, str]:
        """(connection to the URL's origin, :authority, :path)."""
        origin, authority, path = split_https_url(url)
        return await self._connection(origin), authority, path

    async def send(self, target: tuple[H3ClientConnection, str, str], method: str, body: bytes | None,
                   content_type: str | None, limit: float) -> ClientResponse:
        connection, authority, path = target
        # `limit` bounds the whole attempt already (Client._attempt): no second timer here
        return await connection.request(method, authority, path, body, content_type, None, self._max_response)

    async def _connection(self, origin: tuple[str, int]) -> H3ClientConnection:
        connection = self._connections.get(origin)
        if connection is not None and connection.usable:   # every request but a connect's: no lock
            return connection
        lock = self._locks.setdefault(origin, asyncio.Lock())
        async with lock:
            connection = self._connections.get(origin)
            if connection is not None and connection.usable:
                return connection
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.aclose()
            configuration = self._tls.quic_configuration(is_client=True, idle_timeout=self._idle_timeout)
            connection = await connect_h3(origin[0], origin[1], configuration, self._connect_timeout,
                                          ca_file=self._tls.ca)
            self._connections[origin] = connection
            return connection

    async def aclose(self) -> None:
        for connection in list(self._connections.values()):
            await connection.aclose()
        self._connections.clear()
