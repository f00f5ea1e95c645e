"""HTTP/2 client adapter on ngh2's sans-IO connection (libnghttp2): up to `MAX_CONNECTIONS`
per origin (client_base.Origins), each used once the server's SETTINGS arrived; a request's
headers and body leave in one write. A request that ends before its exchange did resets its
stream (CANCEL), so the server's concurrency slot is freed at once. A stream the server
refused (REFUSED_STREAM) or above a GOAWAY's last stream id was certainly not processed
(sent=False, RFC 9113 8.7 and 6.8); a reset or a lost connection after the request went out
may have been.
"""

from __future__ import annotations

import asyncio

import ngh2

from .client_base import ClientConnection, ClientResponse, Origins, TransportError, request_headers
from .h2base import ErrorCodes, H2Endpoint, Setting, error_name
from .tlsconfig import H2_ALPN, TLSConfig

MAX_CONNECTIONS = 16   # per origin


class H2ClientConnection(H2Endpoint, ClientConnection):
    """One HTTP/2 connection to a server: requests as streams, answers to their futures;
    ready once the server's first SETTINGS came."""

    def __init__(self, max_response: int, freed: asyncio.Event):
        H2Endpoint.__init__(self, ngh2.Connection(ngh2.Role.CLIENT))
        ClientConnection.__init__(self, max_response)
        self._freed = freed   # the origin's: set whenever a stream of this connection ends
        self._room = 0   # the server's SETTINGS_MAX_CONCURRENT_STREAMS

    @property
    def has_room(self) -> bool:
        return len(self._exchanges) < self._room

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport   # type: ignore[assignment] (uvloop's are not asyncio.Transport)
        self._conn.initiate_connection({Setting.ENABLE_PUSH: 0})
        self.transmit()

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        try:
            self._conn.receive_data(data)
        except ngh2.NGH2Error as exc:
            self._lost(TransportError(f"HTTP/2 protocol error from the server: {exc}", sent=True))
            self._transport.close()
            return
        self._on_events(self._conn.events())
        self.transmit()
        self._on_events(self._conn.events())   # what sending ended: streams, a connection error's GOAWAY

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._lost(TransportError(f"HTTP/2 connection lost{f': {exc}' if exc else ''}", sent=True))
        self._window_open.set()

    def _on_events(self, events: list) -> None:
        for event in events:
            kind = type(event)
            if kind is ngh2.DataReceived:
                exchange = self._exchanges.get(event.stream_id)
                if exchange is None or exchange.future.done():
                    continue
                if not exchange.add(event.data):
                    self._reset(event.stream_id, ErrorCodes.CANCEL)
                    exchange.sent_all = True
                elif event.end_stream:
                    exchange.finish()
            elif kind is ngh2.ResponseReceived:
                exchange = self._exchanges.get(event.stream_id)
                if exchange is not None:
                    exchange.head(event.headers)
                    if event.end_stream:
                        exchange.finish()
            elif kind is ngh2.StreamClosed:
                exchange = self._exchanges.get(event.stream_id)
                if exchange is not None and not exchange.ended:   # reset by the server, or by libnghttp2
                    code = event.error_code   # REFUSED_STREAM: not processed
                    exchange.fail(TransportError(f"stream reset by the server ({error_name(code)})",
                                                 sent=code != ErrorCodes.REFUSED_STREAM))
            elif kind is ngh2.TrailersReceived:
                exchange = self._exchanges.get(event.stream_id)
                if exchange is not None:
                    exchange.finish()
            else:
                self._on_connection_event(event)

    def _on_connection_event(self, event: ngh2.Event) -> None:
        kind = type(event)
        if kind is ngh2.SettingsReceived:
            self._room = self._conn.remote_settings[Setting.MAX_CONCURRENT_STREAMS]
            if not self._ready.done():
                self._ready.set_result(None)
            self._window_open.set()
        elif kind is ngh2.WindowUpdated:
            self._window_open.set()
        elif kind is ngh2.GoAwayReceived:
            # GOAWAY: streams above last_stream_id were not processed and may go elsewhere;
            # those at or below it are still answered, until the server closes
            last = event.last_stream_id
            detail = f"HTTP/2 GOAWAY from the server ({error_name(event.error_code)})"
            self._closed = TransportError(detail, sent=False)
            for stream_id, exchange in list(self._exchanges.items()):
                if stream_id > last:
                    exchange.fail(self._closed)
            if not self._ready.done():
                self._ready.set_exception(TransportError(detail, sent=False))
            self._freed.set()
        elif kind is ngh2.ConnectionClosed and self._transport is not None:
            self._lost(TransportError(f"HTTP/2 connection ended ({error_name(event.error_code)})", sent=True))
            self._transport.close()

    # ---- requests -------------------------------------------------------------------------
    async def settled(self) -> None:
        """Wait for the server's SETTINGS: it admitted us, and its limits are known."""
        await self._ready

    async def request(self, method: str, authority: str, path: str, body: bytes | None,
                      content_type: str | None) -> ClientResponse:
        if self._closed is not None:
            raise TransportError(str(self._closed), sent=False)
        try:
            stream_id = self._conn.send_request(request_headers(method, authority, path, body, content_type),
                                                end_stream=not body)
            if body:
                self._conn.send_data(stream_id, body, end_stream=True)
        except ngh2.NGH2Error as exc:   # ids exhausted, the connection ending
            raise TransportError(f"HTTP/2 stream not opened: {exc}", sent=False) from exc
        exchange = self._exchange(stream_id)
        self.transmit()   # libnghttp2 opens the stream as it writes it
        exchange.sent_all = not body or not self._conn.queued_body_size(stream_id)
        try:
            if not exchange.sent_all:
                exchange.sent_all = await self._sent(stream_id, None, exchange.future) == "sent"
            return await exchange.future
        finally:
            del self._exchanges[stream_id]
            if not (exchange.ended and exchange.sent_all):
                self._reset(stream_id, ErrorCodes.CANCEL)   # the server's slot is freed now, not never
            self.last_used = self._loop.time()
            self._freed.set()
            if self._closed is not None and not self._exchanges:
                self.close()   # after a GOAWAY: the last answer is in

    def _lost(self, error: TransportError) -> None:
        self._fail_all(error, TransportError(str(error), sent=error.sent))
        self._freed.set()

    def retire(self) -> None:
        """Out of the pool: closed unless a GOAWAY came (then it closes after its last answer)."""
        if self._closed is None:
            self.close()

    def close(self) -> None:
        """GOAWAY, then close (requests still on it fail)."""
        if self._closed is None:
            self._closed = TransportError("HTTP/2 connection closed by this client", sent=False)
        self._goaway_and_close()


class H2Origins(Origins):
    """The HTTP/2 connections of one client, per origin."""

    def __init__(self, tls: TLSConfig, **options):
        super().__init__(tls, max_connections=MAX_CONNECTIONS, **options)
        self._context = tls.client_ssl_context()

    async def _open(self, origin: tuple[str, int], freed: asyncio.Event) -> H2ClientConnection:
        """A TLS 1.3 connection with ALPN h2, our certificate presented, the server's checked
        (ssl's hostname check against the CA), once the server's SETTINGS arrived."""
        (host, port), timeout = origin, self._connect_timeout
        protocol: H2ClientConnection | None = None
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await asyncio.get_running_loop().create_connection(
                    lambda: H2ClientConnection(self._max_response, freed), host, port, ssl=self._context,
                    server_hostname=host, ssl_handshake_timeout=timeout)
                ssl_object = transport.get_extra_info("ssl_object")
                if ssl_object is None or ssl_object.selected_alpn_protocol() != H2_ALPN:
                    raise TransportError(f"{host}:{port} did not agree to HTTP/2 (ALPN)", sent=False)
                await protocol.settled()
        except BaseException:
            if protocol is not None:   # the caller's deadline too: do not leak the socket
                protocol.close()
            raise
        return protocol
