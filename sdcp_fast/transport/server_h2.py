"""HTTP/2 over TLS 1.3 (TCP) on the sans-IO h2 state machine, hardened against hostile clients.

A connection goes through three stages, each bounded:
  1. `TCPListener` accepts, `TLSAcceptor` takes the bare socket: the ClientHello is peeked at (a client that offers no "h2" is refused
     with no_application_protocol), then the TLS 1.3 handshake runs under
     `handshake_timeout`; at most `max_handshakes` run at once, and past that the oldest is
     dropped (a slow-loris of idle TCP connections cannot lock out clients that finish a
     handshake in milliseconds). After it, the certificate policy (certpolicy.py, the same
     as HTTP/3) names the caller, and the connection caps (total, per identity, and a
     penalty for clients told to calm down) admit it or refuse it with a GOAWAY.
  2. `H2ServerProtocol`: RFC 9113 under abuse. A malformed request resets its own stream
     (PROTOCOL_ERROR), never the connection; a header list over the advertised
     SETTINGS_MAX_HEADER_LIST_SIZE is answered 431; streams over
     SETTINGS_MAX_CONCURRENT_STREAMS are refused (REFUSED_STREAM); streams reset before
     their answer (or refused) beyond `max_early_resets` per `early_reset_window_s` end the
     connection with ENHANCE_YOUR_CALM (the 2023 rapid-reset attack), and the client is
     refused for `calm_penalty_s`; a HEAD answer carries no content.
  3. Timers: the client preface and any frame must arrive whole within `header_timeout`; a
     request body within `body_timeout` (408); a response stalled by flow control longer
     than `send_timeout` is reset (CANCEL); a connection with no stream for `idle_timeout`
     is closed.
Every refusal goes through `Serving.refusals` (counted by kind, logged once per client and
minute).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import h2.utilities
import hyperframe.frame
from hpack.exceptions import HPACKError

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import Problem

from . import clienthello
from .exchange import (
    IncomingRequest,
    Malformed,
    PendingBodies,
    log_answer,
    overdue_response,
    response_headers,
)
from .h2_lean import (
    QUIET_CONNECTION_STATES,
    LeanConnection,
    lean_config,
    received_data_frame,
    stream_path,
    walk,
)
from .hpack_blocks import header_block
from .http import Request, Response, body_timeout_response, failure_response, problem_response
from .identity import CertificateRejected
from .refusals import Kind, log
from .serving import Serving
from .strikes import REFUSED_STATUSES, ConnectionStrikes, CountsStrikes

DISCARD_LIMIT = 4 << 20  # bytes of a refused upload read and dropped before resetting the stream
PEEK_RETRY_S = 0.005     # a ClientHello split over several TCP segments: look again this soon
ErrorCodes = h2.errors.ErrorCodes
_CONNECTION = h2.connection.ConnectionInputs
# connection states in which h2 takes a request's HEADERS and then its DATA
_TAKES_REQUESTS = (h2.connection.ConnectionState.IDLE, h2.connection.ConnectionState.SERVER_OPEN)
_STREAM = h2.stream.StreamInputs
_STREAM_OPEN = h2.stream.STREAM_OPEN   # by stream state: whether it counts as open (H2Stream.open)
_MAX_STREAMS = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS
_INITIAL_WINDOW = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
_NO_STREAM_LIMIT = 2**32 + 1   # h2's max_concurrent_streams where none is set
_ORDERED_SET = collections.OrderedDict.__setitem__
_REQUEST_RECEIVED, _DATA_RECEIVED = h2.events.RequestReceived, h2.events.DataReceived
_STATE = h2.stream.StreamState
# a whole request's steps through a new stream's state machine, from h2's table (h2_lean.walk):
# its headers (not ending the stream), its data, the end of the stream
_REQUEST_OPENS = stream_path(_STATE.IDLE, _STREAM.RECV_HEADERS)
_REQUEST_DATA_ENDS = stream_path(_STATE.OPEN, _STREAM.RECV_DATA, _STREAM.RECV_END_STREAM)


# ---------------------------------------------------------------------------------------
# stage 1: the TCP connection until the handshake is done and the caller admitted


class TCPListener:
    """The listening socket: each accepted connection goes to a `TLSAcceptor`.

    Accepting here (not `loop.create_server`) leaves a new connection a bare socket until its
    ClientHello has been looked at: on uvloop a transport reads the first bytes before the
    protocol can pause it, so the peek would find nothing. The same code runs on both loops."""

    def __init__(self, serving: Serving, sock: socket.socket):
        self._serving = serving
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
            TLSAcceptor(self._serving, sock, peer).start()

    def close(self) -> None:
        self._task.cancel()
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class TLSAcceptor:
    """One accepted TCP socket until the TLS 1.3 handshake with a client certificate completes."""

    def __init__(self, serving: Serving, sock: socket.socket, peer: Any):
        self._serving = serving
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
                protocol = H2ServerProtocol(serving, peer)
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
            hello, size = await _peek_client_hello(sock)
        except (clienthello.Unparsed, OSError):
            return True  # not ours to judge: OpenSSL refuses what is not TLS 1.3
        if hello.offers(b"h2"):
            return True
        offered = "no ALPN" if hello.alpn is None else f"ALPN {[p.decode('latin-1') for p in hello.alpn]}"
        self._serving.refusals.refuse(Kind.ALPN, self._peer, f"h2 not offered ({offered}): no_application_protocol")
        with contextlib.suppress(OSError):
            sock.recv(size)   # read, so that the close is a FIN after the alert, not a reset
            sock.send(clienthello.NO_APPLICATION_PROTOCOL_ALERT)   # 7 bytes: fits any send buffer
            sock.shutdown(socket.SHUT_WR)
        return False


async def _peek_client_hello(sock: socket.socket) -> tuple[clienthello.Hello, int]:
    """The ClientHello waiting on the socket, read with MSG_PEEK so that OpenSSL still reads
    it (no transport reads the socket yet); with the bytes it spans."""
    loop = asyncio.get_running_loop()
    while True:
        readable = loop.create_future()
        loop.add_reader(sock.fileno(), _set_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
        try:
            data = sock.recv(clienthello.MAX_HELLO, socket.MSG_PEEK)
        except BlockingIOError:
            continue   # woken with nothing to read
        if not data:
            raise ConnectionResetError("closed before the ClientHello")
        try:
            return clienthello.parse(data), len(data)
        except clienthello.Incomplete:
            if len(data) >= clienthello.MAX_HELLO:
                raise clienthello.Unparsed("ClientHello too long") from None
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


# ---------------------------------------------------------------------------------------
# h2 with RFC 9113's stream errors kept to their stream


class StreamError(h2.events.Event):
    """Our event: a request on `stream_id` was refused by h2 as a stream error and its stream
    reset; the connection goes on. `kind` is the refusal kind (malformed, or over the
    concurrent-stream limit); `flow_controlled_length`: DATA bytes to credit back."""

    def __init__(self, stream_id: int, kind: str, reason: str, flow_controlled_length: int = 0):
        self.stream_id = stream_id
        self.kind = kind
        self.reason = reason
        self.flow_controlled_length = flow_controlled_length


class ServerConnection(LeanConnection):
    """h2's connection, where the errors RFC 9113 makes stream errors stay stream errors.

    h2 raises a malformed request (here: a bad or conflicting content-length, a body that does
    not match it) and a stream beyond SETTINGS_MAX_CONCURRENT_STREAMS as connection errors and
    sends GOAWAY, killing unrelated streams. Header fields are validated by exchange.malformed
    (h2's own inbound validation is off); what h2 still finds on one stream becomes
    RST_STREAM(PROTOCOL_ERROR), a stream over the limit RST_STREAM(REFUSED_STREAM) (RFC 9113
    5.1.2), each with a StreamError event. HPACK errors and oversized header blocks stay
    connection errors: the shared compression state cannot be trusted after them.
    """

    PRUNE_EVERY = 8   # closed streams kept past their end at most (h2 walks every stream to count)
    _over_limit = False
    _counted: int | None = None   # open inbound streams, as counted for the header block at hand
    _prune_at = 0                 # the number of streams held at which the next count is due

    @property
    def open_inbound_streams(self) -> int:
        # h2 refuses a stream over the limit before decoding its header block; while one is
        # let through to be decoded (and then refused), h2's own check must pass. Counting
        # walks every stream: h2's check reuses the count just made for this block
        if self._over_limit:
            return 0
        return self._counted if self._counted is not None else super().open_inbound_streams

    def _receive_headers_frame(self, frame):
        stream_id = frame.stream_id
        if stream_id not in self.streams:
            limit = self.local_settings.max_concurrent_streams
            # every stream h2 still holds (open ones, and closed ones until a count prunes
            # them) bounds the open ones from above (a server opens none: push is off).
            # Below the limit that bound is the count h2's check needs; the walk, which
            # also prunes the closed ones, runs once PRUNE_EVERY streams have been added
            # since the last, or when the bound reaches the limit
            known = len(self.streams)
            if known < self._prune_at and known < limit:
                self._counted = known
            else:
                self._counted = super().open_inbound_streams
                self._prune_at = self._counted + self.PRUNE_EVERY
            self._over_limit = self._counted >= limit
        try:
            frames, events = super()._receive_headers_frame(frame)
        except h2.exceptions.ProtocolError as exc:
            if not self._stream_level(exc, stream_id):
                raise
            return self._stream_error(stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED, str(exc))
        finally:
            over, self._over_limit, self._counted = self._over_limit, False, None
        if not over:
            return frames, events
        limit = self.local_settings.max_concurrent_streams
        return self._stream_error(stream_id, ErrorCodes.REFUSED_STREAM, Kind.STREAM_LIMIT,
                                  f"over max_concurrent_streams={limit}")

    def _receive_data_frame(self, frame):
        try:
            return super()._receive_data_frame(frame)
        except h2.exceptions.InvalidBodyLengthError as exc:
            return self._stream_error(frame.stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED,
                                      str(exc), frame.flow_controlled_length)

    def _receive_message(self, stream_id: int, block: bytes, body: bytes):
        """A request whose HEADERS and DATA frames arrived whole together (h2_lean), taken in
        one go on a new stream when nothing unusual can happen to it: the connection open,
        the stream id the next one allowed, the stream count below both the limit and the
        next prune walk (so `_receive_headers_frame` would count it the same way and let it
        through), the body within the connection's and a new stream's window. Then the
        steps h2 takes for the two frames run here, each through h2's own state machines,
        window managers and stream methods (its `_receive_frame` dispatch, frame objects and
        checks that cannot fail here left out), and their errors end as they end there: a
        header block that does not decode, or an error of the connection, raises; an error
        h2 finds on the stream alone is a stream error; so is a body that does not match
        its content-length. Anything else: None, nothing changed, the frames go one by one."""
        size = len(body)
        known = len(self.streams)
        # h2's settings, read as its properties read them (a Python call or three each)
        settings = self.local_settings._settings
        limit = settings.get(_MAX_STREAMS)
        limit = _NO_STREAM_LIMIT if not limit or limit[0] is None else limit[0]
        window = settings[_INITIAL_WINDOW][0]
        if (not stream_id & 1 or stream_id <= self.highest_inbound_stream_id
                or self.state_machine.state not in _TAKES_REQUESTS
                or known >= self._prune_at or known >= limit
                or size > self._inbound_flow_control_window_manager.current_window_size
                or size > window):
            return None
        headers = h2.connection._decode_headers(self.decoder, block)
        config = self.config
        if (self.state_machine.state not in QUIET_CONNECTION_STATES or config.validate_inbound_headers
                or config.normalize_inbound_headers or config.header_encoding
                or h2.utilities.is_informational_response(headers)):
            return self._receive_message_by_h2(stream_id, headers, body)
        # as _receive_headers_frame + _receive_data_frame and the stream's receive_headers +
        # receive_data would, with the connection's state machine left as it stays (open).
        # The new stream as _begin_new_stream makes it (its id checked above)
        stream = h2.stream.H2Stream(stream_id, config, window, self.remote_settings._settings[_INITIAL_WINDOW][0])
        stream.max_outbound_frame_size = self.max_outbound_frame_size
        self.streams[stream_id] = stream
        self.highest_inbound_stream_id = stream_id
        machine = stream.state_machine
        events = walk(machine, _REQUEST_OPENS)   # RequestReceived
        try:
            stream._initialize_content_length(headers)
        except h2.exceptions.ProtocolError as exc:
            if not self._stream_level(exc, stream_id):
                raise
            events = self._stream_error(stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED, str(exc))[1]
            return events + self._receive_frame(received_data_frame(stream_id, body))
        events[0].headers = headers   # a list of its own, unchanged: the inbound options are off
        self._inbound_flow_control_window_manager.window_consumed(size)
        stream._inbound_window_manager.window_consumed(size)
        try:
            # checked before the data's step (h2 checks it after): that step leaves the
            # state as it is (OPEN), and the DataReceived it makes is dropped on this error
            stream._track_content_length(size, True)
        except h2.exceptions.InvalidBodyLengthError as exc:
            return events + self._stream_error(stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED, str(exc),
                                               size)[1]
        ended = walk(machine, _REQUEST_DATA_ENDS)   # DataReceived, StreamEnded
        data = ended[0]
        data.stream_ended, data.data, data.flow_controlled_length = ended[1], body, size
        events += ended
        return events

    def _receive_message_by_h2(self, stream_id: int, headers: list, body: bytes):
        """`_receive_message` with the header block decoded, through the stream's own
        receive_headers and receive_data (the connection's first request, a header block h2
        would see as informational, inbound options on)."""
        size = len(body)
        events = self.state_machine.process_input(_CONNECTION.RECV_HEADERS)
        stream = self._begin_new_stream(stream_id, h2.connection.AllowedStreamIDs.ODD)
        try:
            _, stream_events = stream.receive_headers(headers, False, self.config.header_encoding)
        except h2.exceptions.ProtocolError as exc:
            if not self._stream_level(exc, stream_id):
                raise
            events = self._stream_error(stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED, str(exc))[1]
            # the DATA frame meets a reset stream: h2's handling, as when it arrives alone
            return events + self._receive_frame(received_data_frame(stream_id, body))
        events += stream_events
        data_events = self.state_machine.process_input(_CONNECTION.RECV_DATA)
        self._inbound_flow_control_window_manager.window_consumed(size)
        try:
            _, stream_events = stream.receive_data(body, True, size)
        except h2.exceptions.InvalidBodyLengthError as exc:
            return events + self._stream_error(stream_id, ErrorCodes.PROTOCOL_ERROR, Kind.MALFORMED, str(exc),
                                               size)[1]
        return events + data_events + stream_events

    def acknowledge_request_data(self, stream_id: int, size: int) -> None:
        """h2's acknowledge_received_data(size, stream_id) for a stream h2 holds: the same
        window managers take the bytes, and the WINDOW_UPDATE frames they ask for (the
        connection's, then the stream's while it is open) are queued the same way, without
        h2's look-up of the stream and its frame list made for nothing. Anything else goes
        to h2's, with its errors."""
        stream = self.streams.get(stream_id)
        if stream is None or size < 0:
            self.acknowledge_received_data(size, stream_id)
            return
        frames = None
        increment = self._inbound_flow_control_window_manager.process_bytes(size)
        if increment:
            frames = [_window_update(0, increment)]
        if _STREAM_OPEN[stream.state_machine.state]:
            increment = stream._inbound_window_manager.process_bytes(size)
            if increment:
                frames = [*(frames or ()), _window_update(stream_id, increment)]
        if frames:
            self._prepare_for_sending(frames)

    def _stream_level(self, exc: h2.exceptions.ProtocolError, stream_id: int) -> bool:
        if isinstance(exc, h2.exceptions.DenialOfServiceError | h2.exceptions.TooManyStreamsError):
            return False
        if isinstance(exc.__cause__, HPACKError | IndexError | TypeError | UnicodeDecodeError):
            return False  # the header block could not be decoded
        stream = self.streams.get(stream_id)
        return stream is not None and not stream.closed

    def _stream_error(self, stream_id: int, code: ErrorCodes, kind: str, reason: str, length: int = 0):
        self.reset_stream(stream_id, code)
        return [], [StreamError(stream_id, kind, reason, length)]

    def send_whole_answer(self, stream_id: int, block: bytes, body: bytes) -> bool:
        """An answer in one go (h2_lean): its HEADERS frame, `block` from `answer_block`,
        and at most one DATA frame. False, with nothing changed, where h2's own path must
        send it: a stream h2 no longer holds, or a message `fits` refuses. Raises what
        send_headers raises on a stream or connection that can no longer send."""
        stream = self.streams.get(stream_id)
        if stream is None or not self.fits(stream.outbound_flow_control_window, block, body):
            return False
        self.send_whole(stream, block, body)
        machine = stream.state_machine
        if machine.state is _STATE.CLOSED:
            # the stream's end (the request had ended it on the client's side): out of the
            # streams h2 holds now, as h2's next count of them would take it out, its end
            # remembered the same way (which h2 tells frames that still come for it by)
            del self.streams[stream_id]
            closed = self._closed_streams   # h2's SizeLimitDict: its __setitem__ without two Python calls
            _ORDERED_SET(closed, stream_id, machine.stream_closed_by)
            if closed._size_limit is not None and len(closed) > closed._size_limit:
                closed._check_size_limit()
        return True


def _window_update(stream_id: int, increment: int) -> hyperframe.frame.WindowUpdateFrame:
    frame = hyperframe.frame.WindowUpdateFrame(stream_id)
    frame.window_increment = increment
    return frame


_ANSWER_BLOCKS: dict[tuple[int, str | None], bytes] = {}   # (status, content type) -> header block
_ANSWER_BLOCKS_MAX = 64


def answer_block(response: Response) -> bytes | None:
    """The header block of an answer of `response`'s status and content-type, coded once for
    all connections (hpack_blocks.header_block). None for an answer with headers of its own, or
    an informational one (h2 codes those)."""
    key = (response.status, response.content_type)
    block = _ANSWER_BLOCKS.get(key)
    if block is None and not response.headers and response.status >= 200:
        block = header_block(response_headers(response))
        if len(_ANSWER_BLOCKS) < _ANSWER_BLOCKS_MAX:
            _ANSWER_BLOCKS[key] = block
    return None if response.headers else block


def _partial_frame(conn: h2.connection.H2Connection) -> bool:
    """Whether h2 holds part of a frame, or a header block awaiting CONTINUATION (private
    names of h2 4.x: without them the header timeout falls back to the idle timeout)."""
    buffer = conn.incoming_buffer
    return bool(getattr(buffer, "_data", b"") or getattr(buffer, "_headers_buffer", ()))


# ---------------------------------------------------------------------------------------
# stage 2 and 3: one authenticated HTTP/2 connection


class H2ServerProtocol(CountsStrikes, asyncio.Protocol):
    def __init__(self, serving: Serving, peer: object):
        self._serving = serving
        self._limits = serving.limits
        self._peer = peer
        self.caller: str | None = None
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        # inbound fields are validated by exchange.malformed; outbound ones are built by
        # exchange.response_headers (lowercase names, our own values): h2 checking and
        # normalising them again costs a pass over every field of every answer
        self._conn = ServerConnection(lean_config(
            client_side=False, validate_inbound_headers=False, normalize_inbound_headers=False))
        self._pending = PendingBodies(self._limits.body_timeout, self._body_overdue)  # bodies arriving
        self._discarding: dict[int, int] = {}  # refused uploads still arriving -> bytes still allowed
        self._tasks: dict[int, asyncio.Task[None]] = {}  # streams being answered
        self._handler_limits: Deadlines | None = None   # the handler time limit of each request (start())
        self._window_open = asyncio.Event()  # flow-control credit arrived
        self._writable = asyncio.Event()  # transport buffer below its high-water mark
        self._writable.set()
        self._can_write = True   # the same, as a plain attribute (read by every answer)
        self._loop: asyncio.AbstractEventLoop | None = None   # the running loop, from start()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._preface_seen = False
        self._last_activity = 0.0
        self._strikes = ConnectionStrikes(self._limits)  # early resets and refused requests
        self._closing = False
        self._flush_queued = False   # a flush of answers waits for the loop's next turn
        # Bytes decrypted together with the client's Finished reach data_received before
        # start() has checked the certificate: keep them (bounded).
        self._early: list[bytes] = []

    @property
    def _client(self) -> object:
        return self.caller or self._peer

    # ---- admission -----------------------------------------------------------------------
    def start(self, transport: asyncio.Transport) -> None:
        """Called by TLSAcceptor once the handshake is done: check the certificate, admit."""
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._handler_limits = Deadlines(self._loop)
        serving = self._serving
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            serving.refusals.refuse(Kind.ALPN, self._peer, "TLS done without ALPN h2")
            transport.abort()
            return
        try:
            der = ssl_object.getpeercert(binary_form=True)
            if not der:
                raise CertificateRejected(CertificateRejected.MISSING, "no client certificate")
            self.caller = serving.certificates.check_der(der)
        except CertificateRejected as exc:
            serving.refusals.refuse(Kind.CERTIFICATE, self._peer, f"h2: refused client {self._peer}: {exc}")
            transport.abort()
            return
        self._conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self._limits.max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self._limits.max_header_list,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        # The advertised size is enforced per request (431, the connection goes on); HPACK
        # itself stops decoding far above it (a connection error: ENHANCE_YOUR_CALM).
        self._conn.decoder.max_header_list_size = max(4 * self._limits.max_header_list, 1 << 16)
        self._conn.initiate_connection()
        refusal = serving.admit(self, self.caller)
        if refusal is not None:
            kind, detail = refusal
            serving.refusals.refuse(kind, self.caller, detail)
            code = ErrorCodes.NO_ERROR if kind == Kind.CONNECTIONS else ErrorCodes.ENHANCE_YOUR_CALM
            self._conn.close_connection(code, additional_data=detail.encode())
            self._flush()
            transport.close()
            return
        self._admitted = True
        log.debug("h2: connection from %s as %s (%s)", self._peer, self.caller, ssl_object.version())
        self._flush()
        self._arm_idle_timer()
        self._arm_header_timer()
        early, self._early = b"".join(self._early), []
        if early:
            self.data_received(early)

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass  # start_tls does not call this; TLSAcceptor calls start() once the caller is known

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            if self._transport is None and sum(map(len, self._early)) + len(data) <= 1 << 20:
                self._early.append(data)
            return
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            kind = Kind.HEADERS_TOO_LARGE if isinstance(exc, h2.exceptions.DenialOfServiceError) else Kind.PROTOCOL
            self._serving.refusals.refuse(kind, self._client, f"h2: connection error: {exc}")
            if kind == Kind.HEADERS_TOO_LARGE:
                # a header block far over the advertised size: HPACK decoded a full budget
                # of it before giving up, which a client must not get again at once
                self._serving.calm_down(self.caller)
            self._flush()  # h2 has queued a GOAWAY
            self._close_transport()
            return
        index, count = 0, len(events)
        while index < count:
            event = events[index]
            index += 1
            if event.__class__ is _REQUEST_RECEIVED and event.stream_ended is None and index + 1 < count:
                # a whole request: its headers, then data that ends the stream (h2's DataReceived
                # and StreamEnded): the three taken in one go
                body = events[index]
                if (body.__class__ is _DATA_RECEIVED and body.stream_id == event.stream_id
                        and body.stream_ended is not None and body.stream_ended is events[index + 1]):
                    index += 2
                    self._on_whole_request(event, body)
                    if self._transport is None or self._transport.is_closing():
                        return
                    continue
            self._on_event(event)
            if self._transport is None or self._transport.is_closing():
                return
        conn = self._conn
        if conn._data_to_send:   # h2's queue (h2_lean reads it too): most reads queue nothing
            self._flush()
        # the header timer has nothing to do when it is not running and no frame is begun
        # (`_partial_frame`, with h2's buffer names h2_lean.receive_data reads anyway)
        buffer = conn.incoming_buffer
        if self._header_timer is not None or not self._preface_seen or buffer._data or buffer._headers_buffer:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._serving.release(self, self.caller)
        for task in self._tasks.values():
            task.cancel()
        self._pending.clear()
        self._window_open.set()
        self._writable.set()
        self._can_write = True
        for timer in (self._idle_timer, self._header_timer):
            if timer is not None:
                timer.cancel()
        self._handler_limits.close()
        log.debug("h2: connection from %s (%s) closed%s", self._peer, self.caller, f": {exc}" if exc else "")

    def pause_writing(self) -> None:
        self._writable.clear()
        self._can_write = False

    def resume_writing(self) -> None:
        self._writable.set()
        self._can_write = True

    # ---- h2 events -----------------------------------------------------------------------
    def _on_event(self, event: h2.events.Event) -> None:
        self._preface_seen = True
        if isinstance(event, h2.events.RequestReceived):
            self._last_activity = self._loop.time()
            self._on_headers(event.stream_id, event.headers, event.stream_ended is not None)
        elif isinstance(event, h2.events.DataReceived):
            # Credit is returned whatever happens to the bytes: the limit is enforced per stream.
            self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            incoming = self._pending.get(event.stream_id)
            if incoming is not None:
                refusal = incoming.add_body(event.data)
                if refusal is not None:
                    self._refuse(event.stream_id, refusal, request_complete=False)
            elif event.stream_id in self._discarding:
                self._discard(event.stream_id, len(event.data))
        elif isinstance(event, h2.events.StreamEnded):
            self._discarding.pop(event.stream_id, None)
            incoming = self._pending.take(event.stream_id)
            if incoming is not None:
                self._start(event.stream_id, incoming.finish(self.caller), incoming.head)
        elif isinstance(event, h2.events.StreamReset):
            self._on_reset(event.stream_id)
        elif isinstance(event, StreamError):
            if event.flow_controlled_length:
                self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self._drop_stream(event.stream_id)
            self._stream_refused(event.stream_id, event.kind, event.reason)
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window_open.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            log.info("h2: %s (%s) sent GOAWAY (%s)", self._peer, self.caller, event.error_code)
            self._closing = True
            if not self._tasks:
                self._close_now()

    def _on_whole_request(self, request: h2.events.RequestReceived, data: h2.events.DataReceived) -> None:
        """A request's headers and the data that ends its stream, received together: what
        `_on_event` does with the three events (RequestReceived, DataReceived, StreamEnded)
        one after the other, without waiting for a body (PendingBodies) in between."""
        stream_id = request.stream_id
        self._preface_seen = True
        self._last_activity = self._loop.time()
        # the request's head as remembered (request_heads.head): not changed here
        head = None if self._closing else self._serving.request_heads.head(request.headers)
        if head.__class__ is not IncomingRequest:   # refused: event by event, as ever
            self._on_headers(stream_id, request.headers, False, head)
            for event in (data, data.stream_ended):
                if self._transport is None or self._transport.is_closing():
                    return
                self._on_event(event)
            return
        # Credit is returned whatever happens to the bytes (as in _on_event)
        self._conn.acknowledge_request_data(stream_id, data.flow_controlled_length)
        whole = head.whole(data.data, self.caller)   # as add_body + finish
        if whole.__class__ is Request:
            self._start(stream_id, whole, head.head)
        else:   # over the limit; the stream has ended: nothing is left to discard
            self._refuse(stream_id, whole, request_complete=True)

    def _on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool,
                    incoming: IncomingRequest | Problem | Malformed | None = None) -> None:
        """A request's headers (`incoming`: what request_heads made of them, if known)."""
        if self._closing:  # not processed: the client may safely retry elsewhere (RFC 9113 8.7)
            self._conn.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        serving = self._serving
        if incoming is None:
            incoming = serving.request_heads.incoming(headers)
        if isinstance(incoming, Malformed):
            self._conn.reset_stream(stream_id, ErrorCodes.PROTOCOL_ERROR)
            self._stream_refused(stream_id, Kind.MALFORMED, incoming.reason)
        elif isinstance(incoming, Problem):
            self._refuse(stream_id, incoming, request_complete=ended)
        elif ended:
            self._start(stream_id, incoming.finish(self.caller), incoming.head)
        else:
            self._pending.add(stream_id, incoming)

    def _on_reset(self, stream_id: int) -> None:
        """The client reset a stream. Before its answer was sent, that counts towards the
        rapid-reset budget: opening and resetting streams costs the client nothing and the
        server a request each."""
        owed = stream_id in self._tasks or self._pending.get(stream_id) is not None
        self._drop_stream(stream_id)
        if owed:
            self._count_early_reset(stream_id, "reset by the client before its answer")

    def _drop_stream(self, stream_id: int) -> None:
        self._pending.take(stream_id)
        self._discarding.pop(stream_id, None)
        task = self._tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()

    def _stream_refused(self, stream_id: int, kind: str, detail: str) -> None:
        self._serving.refusals.refuse(kind, self._client, f"h2: stream {stream_id}: {detail}")
        self._count_early_reset(stream_id, detail)

    def _calm_down(self, kind: str, detail: str) -> None:
        """End the connection with ENHANCE_YOUR_CALM and refuse the client for a while."""
        if self._transport is None or self._transport.is_closing():
            return
        self._serving.refusals.refuse(kind, self._client, f"h2: {detail}")
        self._serving.calm_down(self.caller)
        for stream_id in list(self._tasks):
            self._drop_stream(stream_id)
        self._pending.clear()
        self._closing = True
        try:
            self._conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=kind.encode())
        except h2.exceptions.ProtocolError:
            pass
        self._flush()
        self._close_transport()

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: 408, then reset.

        A stalled client gets its answer and the stream ends (RST_STREAM(NO_ERROR) after a
        complete response, RFC 9113 8.1), freeing its buffer and its concurrency slot.
        """
        if self._transport is None:
            return
        self._serving.refusals.refuse(Kind.BODY_TIMEOUT, self._client,
                                      f"h2: stream {stream_id} -> 408: body not complete within "
                                      f"{self._limits.body_timeout}s")
        response = body_timeout_response(self._limits.body_timeout)
        try:
            self._conn.send_headers(stream_id, response_headers(response))
            self._conn.send_data(stream_id, response.body, end_stream=True)
            self._conn.reset_stream(stream_id, ErrorCodes.NO_ERROR)
        except h2.exceptions.H2Error as exc:  # the stream ended meanwhile
            log.debug("h2: could not answer stream %d: %s", stream_id, exc)
        self._flush()

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport, before the upload (if any) has ended.

        RFC 9113 8.1 lets a server cut the upload off with RST_STREAM(NO_ERROR) after a complete
        response, but httpx/httpcore then waits for flow-control credit that never comes and
        times out instead of reading the answer. So the rest of the upload is read and dropped
        (never stored) up to DISCARD_LIMIT bytes, and only a longer one is reset.
        """
        self._pending.take(stream_id)
        kind = {413: Kind.BODY_TOO_LARGE, 415: Kind.MEDIA_TYPE, 431: Kind.HEADERS_TOO_LARGE}.get(problem.status)
        if kind is not None:
            self._serving.refusals.refuse(kind, self._client, f"h2: stream {stream_id} -> {problem.status} {problem.detail}")
        else:
            log.info("h2: stream %d from %s -> %d %s", stream_id, self.caller, problem.status, problem.detail)
        response = problem_response(problem)
        self._conn.send_headers(stream_id, response_headers(response))
        self._conn.send_data(stream_id, response.body, end_stream=True)  # small: fits any window
        if not request_complete:
            self._discarding[stream_id] = DISCARD_LIMIT
        self._count_refused(stream_id, problem.status)

    def _discard(self, stream_id: int, size: int) -> None:
        budget = self._discarding[stream_id] - size
        if budget >= 0:
            self._discarding[stream_id] = budget
            return
        del self._discarding[stream_id]
        self._conn.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _start(self, stream_id: int, request: Request, head: bool) -> None:
        self._tasks[stream_id] = self._serving.spawn(self._answer(stream_id, request, head), self._loop)

    async def _answer(self, stream_id: int, request: Request, head: bool) -> None:
        timeout = self._limits.handler_timeout
        try:
            try:   # exchange.respond_to, with http.dispatch inlined: one await fewer
                with self._handler_limits.timeout(asyncio.current_task(self._loop), timeout):
                    try:
                        response = await self._serving.handle(request)
                    except Exception as exc:
                        response = failure_response(request, exc)
            except TimeoutError:   # only the limit's: the handler's own are answered above
                response = overdue_response(request, timeout)
            if log.isEnabledFor(logging.DEBUG):
                log_answer(request, response)
            # the usual answer in one go; any other through h2 (_send)
            block = None if response.headers else _ANSWER_BLOCKS.get((response.status, response.content_type))
            if block is None:
                block = answer_block(response)
            if block is not None and self._can_write and self._conn.send_whole_answer(
                    stream_id, block, b"" if head else response.body):
                self._flush_answers()
            else:
                await self._send(stream_id, response, head)
            if response.status in REFUSED_STATUSES:
                self._count_refused(stream_id, response.status)
        except (h2.exceptions.StreamClosedError, h2.exceptions.StreamIDTooLowError):
            # the client reset the stream meanwhile; TooLow: h2 no longer knows the stream
            # (over MAX_CLOSED_STREAMS closed since) and there is nobody to answer. Seen in a
            # soak at load average 10 (106 "Task exception was never retrieved"); which path
            # let the answer outlive the stream (a reset cancels its task) is not found yet
            pass
        finally:
            # this task, or none if the stream was dropped: a stream is started once
            self._tasks.pop(stream_id, None)
            self._last_activity = self._loop.time()
            if self._closing and not self._tasks:
                self._close_now()

    async def _send(self, stream_id: int, response: Response, head: bool) -> None:
        """Headers, then the body as flow control allows; no content for HEAD (RFC 9110
        9.3.2); a body that gets no credit for `send_timeout` is cut off (RST_STREAM CANCEL).
        For an answer `_answer` could not send whole (send_whole_answer)."""
        conn = self._conn
        body = b"" if head else response.body
        conn.send_headers(stream_id, response_headers(response), end_stream=not body)
        if body and self._can_write:
            # the usual answer: one DATA frame within the window. h2 checks the window and
            # the frame size before it changes any state, so a refusal leaves the loop below
            # to send it as credit allows
            try:
                conn.send_data(stream_id, body, end_stream=True)
                body = b""
            except (h2.exceptions.FlowControlError, h2.exceptions.FrameTooLargeError):
                pass
        view = memoryview(body)
        loop = asyncio.get_running_loop()
        stalled_since: float | None = None
        while view:
            await self._writable.wait()
            if self._transport is None or self._transport.is_closing():
                return
            window = min(self._conn.local_flow_control_window(stream_id), self._conn.max_outbound_frame_size)
            if window <= 0:
                stalled_since = stalled_since or loop.time()
                left = stalled_since + self._limits.send_timeout - loop.time()
                if left <= 0:
                    self._serving.refusals.refuse(
                        Kind.FLOW_STALLED, self._client,
                        f"h2: stream {stream_id}: no flow-control credit for {self._limits.send_timeout}s")
                    self._conn.reset_stream(stream_id, ErrorCodes.CANCEL)
                    self._flush()
                    return
                self._window_open.clear()
                self._flush()
                try:
                    async with asyncio.timeout(left):
                        await self._window_open.wait()
                except TimeoutError:
                    pass
                continue
            stalled_since = None
            chunk, view = view[:window], view[window:]
            self._conn.send_data(stream_id, bytes(chunk), end_stream=not view)
            if view:
                self._flush()
        self._flush_answers()

    # ---- housekeeping --------------------------------------------------------------------
    def _flush(self) -> None:
        if not self._conn._data_to_send:   # h2's queue: data_to_send() would give b""
            return
        data = self._conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _flush_answers(self) -> None:
        """Send what an answer queued: at once when it is the connection's only stream in
        flight; with other streams in flight, in one write at the start of the loop's next
        turn. The answers of one batch are set together and their tasks run in the same turn
        one after another, so they leave as one TLS record and one send instead of one each
        (and the client reads them in one wake-up). The flush is queued behind those tasks
        and ahead of whatever they wake, the engine's next batch included, so no answer waits
        for a forward pass."""
        if len(self._tasks) <= 1:
            self._flush()
        elif not self._flush_queued:
            self._flush_queued = True
            asyncio.get_running_loop().call_soon(self._flush_queued_answers)

    def _flush_queued_answers(self) -> None:
        self._flush_queued = False
        self._flush()

    def _arm_header_timer(self) -> None:
        """The client preface, and any frame once begun, must arrive whole within
        header_timeout (a client that trickles a header block would hold the connection,
        which accepts nothing else until the block ends)."""
        waiting = not self._preface_seen or _partial_frame(self._conn)
        if waiting and self._header_timer is None:
            self._header_timer = asyncio.get_running_loop().call_later(
                self._limits.header_timeout, self._header_overdue)
        elif not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_overdue(self) -> None:
        self._header_timer = None
        if self._preface_seen and not _partial_frame(self._conn):
            return
        what = "a frame" if self._preface_seen else "the client preface"
        self._serving.refusals.refuse(Kind.HEADER_TIMEOUT, self._client,
                                      f"h2: {what} not complete within {self._limits.header_timeout}s")
        self._closing = True
        self._close_transport()

    def _arm_idle_timer(self) -> None:
        """One timer per connection, re-armed only when it fires (not per packet)."""
        loop = asyncio.get_running_loop()
        self._last_activity = loop.time()
        self._idle_timer = loop.call_later(self._limits.idle_timeout, self._idle_check)

    def _idle_check(self) -> None:
        """Idle means no stream: bytes alone (PINGs, a trickled frame) do not keep a
        connection open."""
        idle_for = asyncio.get_running_loop().time() - self._last_activity
        if self._tasks or self._pending or idle_for < self._limits.idle_timeout:
            remaining = self._limits.idle_timeout - idle_for
            self._idle_timer = asyncio.get_running_loop().call_later(max(remaining, 0.05), self._idle_check)
            return
        self._serving.refusals.refuse(Kind.IDLE, self._client, f"h2: idle for {self._limits.idle_timeout}s: closing")
        self.goaway()

    @property
    def busy(self) -> bool:
        """Answers still to send (stop() waits for these, not for the TLS close exchange)."""
        return bool(self._tasks or self._pending)

    def goaway(self) -> None:
        """Graceful close: refuse new streams (REFUSED_STREAM: safe to retry), answer the ones in
        flight, then GOAWAY and close. No early GOAWAY: httpx/httpcore fails every stream still
        open on a connection once it has seen one, instead of waiting for their answers."""
        self._closing = True
        if not self._tasks:
            self._close_now()

    def _close_now(self) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        try:
            self._conn.close_connection(ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            pass  # already closed by the peer's GOAWAY
        self._flush()
        self._transport.close()

    def _close_transport(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
