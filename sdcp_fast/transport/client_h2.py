"""HTTP/2 client adapter on the sans-IO h2 state machine (mutual TLS 1.3), like the server:
connections kept per origin and reused, requests on one connection as concurrent streams.

Why not httpx: a proposal is one small POST, and httpx + httpcore + anyio spent more CPU on
it than the verifier spends answering it (layers of request/response models, stream
iterators, a lock and a semaphore per request, a read loop per stream). Here one request
is one stream in a dict: its headers and body leave in one write, the connection's
`data_received` hands each response to its waiting future, and nothing else runs.

- Connections: one per origin while its streams fit the server's
  SETTINGS_MAX_CONCURRENT_STREAMS; past that another (up to `MAX_CONNECTIONS` per origin),
  then a request waits for a free stream (within its deadline). A connection is used only
  once the server's SETTINGS arrived (it admitted us); one idle for 0.9 x `idle_timeout` is
  closed rather than reused (a server with the same idle_timeout may be closing it: a request
  written onto it would see only a read error, which a non-idempotent request cannot retry).
- Stream accounting: a request that ends before its exchange did (its caller's deadline, an
  oversized answer) resets its stream (RST_STREAM CANCEL), so the server's concurrency slot
  is freed at once: the leak of httpcore 1.0.x (encode/httpcore#1022) cannot happen here.
- Errors, as `TransportError(sent=...)`: connect, TLS and ALPN failures, a stream the server
  refused (REFUSED_STREAM) and streams above a GOAWAY's last stream id were certainly not
  processed (sent=False, RFC 9113 8.7 and 6.8); a reset or a lost connection after the
  request went out may have been (sent=True). A connect that does not finish within
  `connect_timeout` is a RequestTimeout(sent=False). The caller (`Client._attempt`) bounds
  every request as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import jh2.config
import jh2.connection
import jh2.errors
import jh2.events
import jh2.exceptions
import jh2.settings

from .client_base import (
    ANNOUNCE_LENGTH_FROM,
    ClientResponse,
    RequestTimeout,
    TransportError,
    read_answer_head,
    split_https_url,
)
from .compat import H2Connection
from .tlsconfig import H2_ALPN, TLSConfig

log = logging.getLogger("sdcp_fast.transport")
MAX_CONNECTIONS = 16   # per origin
ErrorCodes = jh2.errors.ErrorCodes


class _Exchange:
    """One request's stream: its answer as it arrives."""

    __slots__ = ("future", "status", "headers", "body", "sent_all", "ended")

    def __init__(self, future: asyncio.Future[ClientResponse]):
        self.future = future
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.sent_all = False   # our END_STREAM went out
        self.ended = False      # the server's END_STREAM (or RST_STREAM) came


class H2ClientConnection(asyncio.Protocol):
    """One HTTP/2 connection to a server: requests as streams, answers to their futures."""

    def __init__(self, max_response: int, freed: asyncio.Event):
        self._max_response = max_response
        self._freed = freed   # the origin's: set whenever a stream of this connection ends
        # our own fields are lowercase literals and values we built, and the answers come
        # from a server that proved its certificate: h2 checks neither again (a field the
        # answer gets wrong is read as a string, `:status` as an int, or the request fails)
        self._conn = H2Connection(jh2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False,
            normalize_outbound_headers=False, validate_inbound_headers=False, normalize_inbound_headers=False))
        self._conn.local_settings = jh2.settings.Settings(client=True, initial_values={
            jh2.settings.SettingCodes.ENABLE_PUSH: 0})
        self._transport: asyncio.Transport | None = None
        self._exchanges: dict[int, _Exchange] = {}
        self._settled = asyncio.get_running_loop().create_future()   # the server's first SETTINGS
        self._window_open = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed: TransportError | None = None   # set once no new stream may start
        self._goaway_last: int | None = None
        self.last_used = asyncio.get_running_loop().time()

    # ---- state the origin pool reads ------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self._closed is None

    @property
    def has_room(self) -> bool:
        return len(self._exchanges) < self._conn.remote_settings.max_concurrent_streams

    @property
    def busy(self) -> bool:
        return bool(self._exchanges)

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport   # type: ignore[assignment] (uvloop's are not asyncio.Transport)
        self._conn.initiate_connection()
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._conn.receive_data(data)
        except jh2.exceptions.ProtocolError as exc:
            self._flush()   # h2 has queued a GOAWAY
            self._fail_all(TransportError(f"HTTP/2 protocol error from the server: {exc}", sent=True))
            self._transport.close()
            return
        for event in events:
            self._on_event(event)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._fail_all(TransportError(f"HTTP/2 connection lost{f': {exc}' if exc else ''}", sent=True))
        self._window_open.set()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _on_event(self, event: jh2.events.Event) -> None:
        if isinstance(event, jh2.events.DataReceived):
            exchange = self._exchanges.get(event.stream_id)
            self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if exchange is None or exchange.future.done():
                return
            exchange.body += event.data
            if len(exchange.body) > self._max_response:
                self._end(event.stream_id, exchange,
                          TransportError(f"response over {self._max_response} bytes", sent=True))
        elif isinstance(event, jh2.events.ResponseReceived):
            exchange = self._exchanges.get(event.stream_id)
            if exchange is not None:
                exchange.status = read_answer_head(event.headers, exchange.headers)
        elif isinstance(event, jh2.events.StreamEnded):
            exchange = self._exchanges.get(event.stream_id)
            if exchange is not None:
                exchange.ended = True
                if exchange.future.done():
                    pass
                elif not exchange.status:
                    exchange.future.set_exception(TransportError("answer without a valid :status", sent=True))
                else:
                    exchange.future.set_result(ClientResponse(exchange.status, exchange.headers,
                                                              bytes(exchange.body)))
        elif isinstance(event, jh2.events.StreamReset):
            exchange = self._exchanges.get(event.stream_id)
            if exchange is not None:
                exchange.ended = True
                if not exchange.future.done():
                    refused = event.error_code == ErrorCodes.REFUSED_STREAM   # not processed
                    exchange.future.set_exception(TransportError(
                        f"stream reset by the server ({_code(event.error_code)})", sent=not refused))
        elif isinstance(event, jh2.events.RemoteSettingsChanged):
            if not self._settled.done():
                self._settled.set_result(None)
            self._window_open.set()
        elif isinstance(event, jh2.events.WindowUpdated):
            self._window_open.set()
        elif isinstance(event, jh2.events.ConnectionTerminated):
            # GOAWAY: streams above last_stream_id were not processed and may go elsewhere;
            # those at or below it are still answered, until the server closes
            self._goaway_last = event.last_stream_id or 0
            detail = f"HTTP/2 GOAWAY from the server ({_code(event.error_code)})"
            self._closed = TransportError(detail, sent=False)
            for stream_id, exchange in list(self._exchanges.items()):
                if stream_id > self._goaway_last and not exchange.future.done():
                    exchange.ended = True
                    exchange.future.set_exception(TransportError(detail, sent=False))
            if not self._settled.done():
                self._settled.set_exception(TransportError(detail, sent=False))
            self._freed.set()

    # ---- requests -------------------------------------------------------------------------
    async def settled(self) -> None:
        """Wait for the server's SETTINGS: it admitted us, and its limits are known."""
        await self._settled

    async def request(self, method: str, authority: str, path: str, body: bytes | None,
                      content_type: str | None) -> ClientResponse:
        if self._closed is not None:
            raise TransportError(str(self._closed), sent=False)
        conn = self._conn
        try:
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(stream_id, _request_headers(method, authority, path, body, content_type),
                              end_stream=not body)
            # a body that fits the window leaves with its headers, in one write (h2 checks
            # the window and the frame size before it changes anything)
            if body and self._writable.is_set():
                with contextlib.suppress(jh2.exceptions.FlowControlError, jh2.exceptions.FrameTooLargeError):
                    conn.send_data(stream_id, body, end_stream=True)
                    body = None
        except jh2.exceptions.H2Error as exc:   # over the server's stream limit, ids exhausted
            raise TransportError(f"HTTP/2 stream not opened: {exc}", sent=False) from exc
        exchange = _Exchange(asyncio.get_running_loop().create_future())
        exchange.sent_all = not body
        self._exchanges[stream_id] = exchange
        try:
            if body:
                await self._send_body(stream_id, exchange, body)
            else:
                self._flush()
            return await exchange.future
        finally:
            del self._exchanges[stream_id]
            if not (exchange.ended and exchange.sent_all):
                self._cancel(stream_id)   # the server's slot is freed now, not never
            self.last_used = asyncio.get_running_loop().time()
            self._freed.set()
            if self._closed is not None and not self._exchanges:
                self.close()   # after a GOAWAY: the last answer is in

    async def _send_body(self, stream_id: int, exchange: _Exchange, body: bytes) -> None:
        """The body as flow control allows; most fit the first window and leave with the
        headers in one write."""
        conn = self._conn
        view = memoryview(body)
        while view:
            if not self._writable.is_set():
                self._flush()
                await self._writable.wait()
            if self._closed is not None and self._transport is None:
                raise TransportError("HTTP/2 connection lost while sending", sent=True)
            if exchange.future.done():
                return   # answered (or reset) before the upload ended
            window = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
            if window <= 0:
                self._window_open.clear()
                self._flush()
                await self._window_open.wait()
                continue
            chunk, view = view[:window], view[window:]
            conn.send_data(stream_id, bytes(chunk), end_stream=not view)
        exchange.sent_all = True
        self._flush()

    def _end(self, stream_id: int, exchange: _Exchange, error: TransportError) -> None:
        exchange.future.set_exception(error)
        self._cancel(stream_id)
        exchange.ended = exchange.sent_all = True

    def _cancel(self, stream_id: int) -> None:
        with contextlib.suppress(jh2.exceptions.H2Error):
            self._conn.reset_stream(stream_id, ErrorCodes.CANCEL)
        self._flush()

    def _fail_all(self, error: TransportError) -> None:
        if self._closed is None:
            self._closed = error
        for exchange in self._exchanges.values():
            exchange.ended = True
            if not exchange.future.done():
                # one object per request: a shared one would gather every raiser's frames in
                # its traceback (the unbounded growth issue 21's soak found in httpcore)
                exchange.future.set_exception(TransportError(str(error), sent=error.sent))
        if not self._settled.done():
            self._settled.set_exception(TransportError(str(error), sent=error.sent))
        self._freed.set()

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        """GOAWAY, then close (requests still on it fail)."""
        if self._closed is None:
            self._closed = TransportError("HTTP/2 connection closed by this client", sent=False)
        if self._transport is not None and not self._transport.is_closing():
            with contextlib.suppress(jh2.exceptions.H2Error):
                self._conn.close_connection()
            self._flush()
            self._transport.close()


def _request_headers(method: str, authority: str, path: str, body: bytes | None,
                     content_type: str | None) -> list[tuple[bytes, bytes]]:
    headers = [(b":method", method.encode()), (b":scheme", b"https"),
               (b":authority", authority.encode()), (b":path", path.encode())]
    if body is not None:
        if content_type:
            headers.append((b"content-type", content_type.encode()))
        if len(body) >= ANNOUNCE_LENGTH_FROM:
            headers.append((b"content-length", str(len(body)).encode()))
    return headers


def _code(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"{code:#x}"


async def connect_h2(host: str, port: int, context: ssl.SSLContext, timeout: float, max_response: int,
                     freed: asyncio.Event) -> H2ClientConnection:
    """A TLS 1.3 connection with ALPN h2, our certificate presented, the server's checked
    (ssl's hostname check against the CA), once the server's SETTINGS arrived."""
    loop = asyncio.get_running_loop()
    protocol: H2ClientConnection | None = None
    try:
        async with asyncio.timeout(timeout):
            transport, protocol = await loop.create_connection(
                lambda: H2ClientConnection(max_response, freed), host, port, ssl=context,
                server_hostname=host, ssl_handshake_timeout=timeout)
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is None or ssl_object.selected_alpn_protocol() != H2_ALPN:
                raise TransportError(f"{host}:{port} did not agree to HTTP/2 (ALPN)", sent=False)
            await protocol.settled()
    except TimeoutError as exc:
        if protocol is not None:
            protocol.close()
        raise RequestTimeout(f"connect to {host}:{port} not done within {timeout}s", sent=False) from exc
    except (OSError, ssl.SSLError, TransportError) as exc:
        if protocol is not None:
            protocol.close()
        if isinstance(exc, TransportError):
            raise
        raise TransportError(f"cannot connect to {host}:{port}: {exc}", sent=False) from exc
    except asyncio.CancelledError:   # the caller's deadline: do not leak the socket
        if protocol is not None:
            protocol.close()
        raise
    return protocol


class H2Origins:
    """The HTTP/2 connections of one client, per origin."""

    def __init__(self, tls: TLSConfig, *, timeout: float, connect_timeout: float, idle_timeout: float,
                 max_response: int):
        self._context = tls.client_ssl_context()
        self._connect_timeout = connect_timeout
        self._max_response = max_response
        self._expiry = 0.9 * idle_timeout   # module docstring
        self._pools: dict[tuple[str, int], list[H2ClientConnection]] = {}
        self._freed: dict[tuple[str, int], asyncio.Event] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    async def open(self, url: str) -> tuple[H2ClientConnection, str, str]:
        """(a connection to the URL's origin with room for a stream, :authority, :path)."""
        origin, authority, path = split_https_url(url)
        return await self._connection(origin), authority, path

    async def send(self, target: tuple[H2ClientConnection, str, str], method: str, body: bytes | None,
                   content_type: str | None, limit: float) -> ClientResponse:
        """One exchange (the caller bounds it by `limit`)."""
        connection, authority, path = target
        return await connection.request(method, authority, path, body, content_type)

    async def _connection(self, origin: tuple[str, int]) -> H2ClientConnection:
        pool = self._pools.setdefault(origin, [])
        freed = self._freed.setdefault(origin, asyncio.Event())
        while True:
            now = asyncio.get_running_loop().time()
            for connection in list(pool):
                if not connection.usable:
                    pool.remove(connection)
                elif not connection.busy and now - connection.last_used > self._expiry:
                    pool.remove(connection)
                    connection.close()
            for connection in pool:
                if connection.has_room:
                    return connection
            if len(pool) < MAX_CONNECTIONS:
                lock = self._connecting.setdefault(origin, asyncio.Lock())
                if not lock.locked():   # one connect at a time per origin; others wait for it
                    async with lock:
                        try:
                            connection = await connect_h2(origin[0], origin[1], self._context,
                                                          self._connect_timeout, self._max_response, freed)
                        finally:
                            freed.set()   # the waiters look again (and connect themselves on failure)
                        pool.append(connection)
                        return connection
            freed.clear()
            await freed.wait()   # a stream ended, or a connect finished (bounded by the caller)

    async def aclose(self) -> None:
        for pool in self._pools.values():
            for connection in pool:
                connection.close()
        self._pools.clear()
