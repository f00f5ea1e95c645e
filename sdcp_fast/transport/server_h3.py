"""HTTP/3 over QUIC on aioquic's QuicServer and H3Connection, with mandatory client certificates,
held to the same limits as HTTP/2 (limits.py).

Every new QUIC connection gets `quic_mtls.require_client_certificate` before its first
datagram; HTTP/3 starts only after the handshake completed with a certificate the policy
(certpolicy.py) accepts, whose URI SAN becomes the caller of every request on the
connection, and once the connection caps admit it. Per connection: MAX_STREAMS is
`max_concurrent_streams`, QUIC flow control `quic_max_data` / `quic_max_stream_data`, the
idle timeout `idle_timeout` (in the QUIC transport parameters), the handshake must finish
within `handshake_timeout`. Per stream: the header block must be whole within
`header_timeout` of the stream's first byte; a malformed request is a stream error
(H3_MESSAGE_ERROR, RFC 9114 4.1.2) instead of aioquic's connection close; a HEADERS frame
longer than `max_header_list` is answered 431 as soon as its length is known, before it is
buffered; early resets count towards the rapid-reset budget (H3_EXCESSIVE_LOAD past it); a
response not delivered within `send_timeout` is reset.
"""

from __future__ import annotations

import asyncio
import functools

from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, ErrorCode, FrameType, MessageError, Setting
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicErrorCode

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import Kind as ProblemKind
from sdcp_fast.core.problems import Problem

from .exchange import IncomingRequest, Malformed, PendingBodies, respond_to, response_headers
from .http import Request, Response, body_timeout_response, problem_response
from .quic_lean import LeanAcks, LeanH3
from .quic_mtls import rejection, require_client_certificate, verified_identity
from .refusals import Kind, log
from .serving import Serving
from .strikes import ConnectionStrikes, CountsStrikes

assert "h3" in H3_ALPN
MAX_REFUSED_TRACKED = 4096   # refused streams whose late data is dropped, per connection


class StreamRefused(H3Event):
    """Our event: the request on `stream_id` was refused at the HTTP/3 layer. `problem` set:
    answer it (431); None: the stream was reset (malformed: H3_MESSAGE_ERROR)."""

    def __init__(self, stream_id: int, kind: str, reason: str, problem: Problem | None):
        self.stream_id = stream_id
        self.kind = kind
        self.reason = reason
        self.problem = problem


class ServerH3Connection(LeanH3):
    """aioquic's H3Connection (without the QPACK dynamic table: quic_lean.py) where what
    RFC 9114 makes a stream error stays one.

    aioquic closes the whole connection on a malformed request (H3_MESSAGE_ERROR); RFC 9114
    4.1.2 makes it a stream error. It also buffers a HEADERS frame of any length. Here a
    MessageError resets its stream only, and a HEADERS frame longer than the header limit is
    refused once its length is read; the rest of such a stream is dropped unread. The
    advertised SETTINGS_MAX_FIELD_SECTION_SIZE is the same limit.
    """

    def __init__(self, quic: QuicConnection, *, max_header_list: int):
        self._max_header_list = max_header_list
        self.whole_headers_limit = max_header_list   # a longer HEADERS frame is refused below
        self._refused: dict[int, None] = {}   # ordered: the oldest forgotten first
        super().__init__(quic)

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings[Setting.MAX_FIELD_SECTION_SIZE] = self._max_header_list
        return settings

    def _receive_request_or_push_data(self, stream, data: bytes, stream_ended: bool) -> list[H3Event]:
        stream_id = stream.stream_id
        if stream_id in self._refused:
            stream.buffer = b""
            if stream_ended:
                stream.receiving_ended = True
                del self._refused[stream_id]
            return []
        try:
            events = super()._receive_request_or_push_data(stream, data, stream_ended)
        except MessageError as exc:
            self._quic.reset_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            self._quic.stop_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            return [self._refuse(stream, Kind.MALFORMED, exc.reason_phrase, None)]
        if stream.frame_type == FrameType.HEADERS and (stream.frame_size or 0) > self._max_header_list:
            size = stream.frame_size
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
            problem = Problem(ProblemKind.HEADERS_TOO_LARGE,
                              f"HEADERS frame of {size} bytes exceeds the limit of {self._max_header_list}")
            return [*events, self._refuse(stream, Kind.HEADERS_TOO_LARGE, problem.detail, problem)]
        return events

    def _refuse(self, stream, kind: str, reason: str, problem: Problem | None) -> StreamRefused:
        stream.buffer = b""
        stream.frame_type = stream.frame_size = None
        if not stream.receiving_ended:
            self._refused[stream.stream_id] = None
            while len(self._refused) > MAX_REFUSED_TRACKED:
                del self._refused[next(iter(self._refused))]
        return StreamRefused(stream.stream_id, kind, reason, problem)


class H3Server(QuicServer):
    """aioquic's QuicServer, where a 1-RTT datagram (short header: every datagram of an
    established connection) reaches its connection without its header parsed twice.

    aioquic's server parses every datagram's header into a QuicHeader only to read its
    destination connection ID, and the connection then parses it again. A short header
    (RFC 9000 17.3: first bit 0, fixed bit 1) has no version, so nothing for version
    negotiation, and is never an Initial, so it never creates a connection: aioquic's server
    only looks its connection up by the ID after the first octet (`connection_id_length` long,
    our configuration's) and hands the datagram on, or drops it. Here that is done without
    the parse; anything else (long headers, a fixed bit of 0, a datagram too short for the ID,
    an unknown ID) takes aioquic's path unchanged."""

    def datagram_received(self, data: bytes, addr) -> None:
        if data and data[0] & 0xC0 == 0x40:
            length = self._configuration.connection_id_length
            if len(data) > length:
                protocol = self._protocols.get(data[1:1 + length])
                if protocol is not None:
                    protocol.datagram_received(data, addr)
                    return
        super().datagram_received(data, addr)


async def serve_h3(host: str, port: int, *, configuration, serving: Serving) -> H3Server:
    """aioquic's `serve` (no session-ticket store, no Retry), on an H3Server."""
    _, server = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: H3Server(configuration=configuration,
                         create_protocol=functools.partial(H3ServerProtocol, serving=serving), retry=False),
        local_addr=(host, port),
    )
    return server


class H3ServerProtocol(CountsStrikes, LeanAcks):
    def __init__(self, quic: QuicConnection, serving: Serving, **kwargs):
        require_client_certificate(quic, serving.certificates)
        # aioquic fixes MAX_STREAMS at 128; it is announced in the transport parameters, so
        # it must be set before the first datagram (a private name of aioquic 1.7.2). `sent`
        # too: aioquic raises MAX_STREAMS by one per closed stream, and only once the new
        # value is ahead of what it believes was announced (with `sent` left at 128, a client
        # would never get a stream beyond the first max_concurrent_streams)
        streams = quic._local_max_streams_bidi
        streams.value = streams.sent = serving.limits.max_concurrent_streams
        super().__init__(quic, **kwargs)
        self._serving = serving
        self._limits = serving.limits
        self._h3: ServerH3Connection | None = None
        self.caller: str | None = None
        self._pending = PendingBodies(self._limits.body_timeout, self._body_overdue)  # bodies arriving
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._strikes = ConnectionStrikes(self._limits)  # early resets and refused requests
        # streams begun, no headers yet (None: while their first data is being handled)
        self._awaiting_headers: dict[int, asyncio.TimerHandle | None] = {}
        self._highest_stream = -1
        self._closing = False
        self._admitted = False
        self._first_datagram = True
        self._written: list[int] = []   # answers written since the last transmit: watched once sent
        loop = asyncio.get_running_loop()
        self._handler_limits = Deadlines(loop)   # the handler time limit of each request
        serving.handshake_started(self, self._drop, None)
        self._handshake_timer = loop.call_later(self._limits.handshake_timeout, self._handshake_overdue)

    @property
    def _client(self) -> object:
        return self.caller or self._peer()

    def datagram_received(self, data: bytes, addr) -> None:
        if self._first_datagram:
            self._first_datagram = False
            if not self._serving.may_connect(addr[0]):
                # dropped before any handshake work: the datagram is not even parsed, and the
                # server forgets the connection (aioquic's handler, set before this call)
                self._serving.refusals.refuse(Kind.CONNECTION_RATE, addr, "h3: new connections too fast")
                self._serving.handshake_ended(self)
                self._handshake_timer.cancel()
                self._connection_terminated_handler()
                return
        super().datagram_received(data, addr)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self._handshake_done()
        elif isinstance(event, ConnectionTerminated):
            self._on_terminated(event)
        elif isinstance(event, StreamReset | StopSendingReceived):
            self._on_reset(event.stream_id)
        elif isinstance(event, StreamDataReceived) and event.stream_id % 4 == 0 \
                and event.stream_id > self._highest_stream and self._h3 is not None:
            # a new request stream: its header block must be whole within header_timeout
            # (timed from now; the timer is armed only if this data did not complete the
            # block, which for a request in one datagram saves a timer armed and cancelled)
            self._highest_stream = event.stream_id
            self._awaiting_headers[event.stream_id] = None
            self._on_h3_events(self._h3.handle_event(event))
            if event.stream_id in self._awaiting_headers:
                self._awaiting_headers[event.stream_id] = asyncio.get_running_loop().call_later(
                    self._limits.header_timeout, self._headers_overdue, event.stream_id)
            return
        if self._h3 is not None:
            self._on_h3_events(self._h3.handle_event(event))

    # ---- admission -----------------------------------------------------------------------
    def _handshake_done(self) -> None:
        self._handshake_timer.cancel()
        self._serving.handshake_ended(self)
        self.caller = verified_identity(self._quic)
        if self.caller is None:  # cannot happen with the hooks in place; refuse if it does
            log.error("h3: handshake completed without a verified client certificate")
            self._close(ErrorCode.H3_INTERNAL_ERROR, "no identity")
            return
        refusal = self._serving.admit(self, self.caller)
        if refusal is not None:
            kind, detail = refusal
            self._serving.refusals.refuse(kind, self.caller, f"h3: {detail}")
            self._close(ErrorCode.H3_EXCESSIVE_LOAD, detail)
            return
        self._admitted = True
        self.lengthen_ack_delay()
        self._h3 = ServerH3Connection(self._quic, max_header_list=self._limits.max_header_list)
        log.debug("h3: connection from %s as %s", self._peer(), self.caller)

    def _handshake_overdue(self) -> None:
        self._serving.refusals.refuse(Kind.HANDSHAKE_TIMEOUT, self._peer(),
                                      f"h3: handshake not done within {self._limits.handshake_timeout}s")
        self._drop()

    def _drop(self) -> None:
        """Over max_handshakes (the oldest makes room), or past handshake_timeout."""
        self._serving.handshake_ended(self)
        self._close(ErrorCode.H3_EXCESSIVE_LOAD, "handshake dropped")

    def _on_terminated(self, event: ConnectionTerminated) -> None:
        self._handshake_timer.cancel()
        self._serving.handshake_ended(self)
        if self._admitted:
            self._serving.release(self, self.caller)
        for task in self._tasks.values():
            task.cancel()
        self._handler_limits.close()
        self._pending.clear()
        for timer in self._awaiting_headers.values():
            if timer is not None:
                timer.cancel()
        self._awaiting_headers.clear()
        if self.caller is None:
            refused = rejection(self._quic)
            reason = refused or event.reason_phrase or f"error {event.error_code:#x}"
            kind = Kind.CERTIFICATE if refused is not None else Kind.TLS
            self._serving.refusals.refuse(kind, self._peer(), f"h3: refused client {self._peer()}: {reason}")
        elif event.error_code == QuicErrorCode.STREAM_LIMIT_ERROR:
            # a stream beyond MAX_STREAMS: QUIC makes it a connection error (RFC 9000 4.6)
            self._serving.refusals.refuse(Kind.STREAM_LIMIT, self.caller,
                                          f"h3: more than {self._limits.max_concurrent_streams} streams "
                                          f"opened: closed ({event.reason_phrase})")
        elif event.reason_phrase == "Idle timeout":  # aioquic's own close
            self._serving.refusals.refuse(Kind.IDLE, self.caller, f"h3: idle for {self._limits.idle_timeout}s: closed")
        else:
            log.debug("h3: connection from %s (%s) closed: %s", self._peer(), self.caller,
                      event.reason_phrase or f"code {event.error_code:#x}")

    # ---- streams -------------------------------------------------------------------------
    def _on_h3_events(self, events: list[H3Event]) -> None:
        if len(events) == 2:
            head, data = events
            if head.__class__ is HeadersReceived and data.__class__ is DataReceived and data.stream_ended \
                    and head.stream_id == data.stream_id and not head.stream_ended:
                # a whole request (as every SDCP request comes): its body is known with its
                # headers, so it is not awaited (no body deadline armed and cancelled)
                self._headers_arrived(head.stream_id)
                self._on_headers(head.stream_id, head.headers, False, data.data)
                return
        for event in events:
            self._on_h3_event(event)

    def _on_h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self._headers_arrived(event.stream_id)
            self._on_headers(event.stream_id, event.headers, event.stream_ended)
        elif isinstance(event, DataReceived):
            incoming = self._pending.get(event.stream_id)
            if incoming is None:
                return  # a refused upload still draining, or a stream we never accepted
            refusal = incoming.add_body(event.data)
            if refusal is not None:
                self._refuse(event.stream_id, refusal, request_complete=event.stream_ended)
            elif event.stream_ended:
                self._pending.take(event.stream_id)
                self._start(event.stream_id, incoming)
        elif isinstance(event, StreamRefused):
            self._headers_arrived(event.stream_id)
            self._pending.take(event.stream_id)
            self._serving.refusals.refuse(event.kind, self._client, f"h3: stream {event.stream_id}: {event.reason}")
            self._count_early_reset(event.stream_id, event.reason)
            if event.problem is not None:
                self._write(event.stream_id, problem_response(event.problem), head=False)
            else:
                self.transmit()

    def _on_headers(self, stream_id: int, headers, ended: bool, body: bytes | None = None) -> None:
        """`body`: the request's whole body, arrived with its headers (None: not yet known)."""
        if self._closing:
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_REJECTED)
            self.transmit()
            return
        incoming = self._serving.request_heads.incoming(headers)
        if isinstance(incoming, Malformed):
            self._quic.reset_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            self._quic.stop_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            self._serving.refusals.refuse(Kind.MALFORMED, self._client, f"h3: stream {stream_id}: {incoming.reason}")
            self._count_early_reset(stream_id, incoming.reason)
            self.transmit()
        elif isinstance(incoming, Problem):
            self._refuse(stream_id, incoming, request_complete=ended)
        elif ended:
            self._start(stream_id, incoming)
        elif body is not None:   # as DataReceived below would take it, without the wait
            refusal = incoming.add_body(body)
            if refusal is not None:
                self._refuse(stream_id, refusal, request_complete=True)
            else:
                self._start(stream_id, incoming)
        else:
            self._pending.add(stream_id, incoming)

    def _headers_arrived(self, stream_id: int) -> None:
        timer = self._awaiting_headers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()

    def _headers_overdue(self, stream_id: int) -> None:
        """A request stream whose header block is still incomplete after header_timeout:
        reset it (it holds a stream of the client's limit and up to a header block)."""
        if self._awaiting_headers.pop(stream_id, None) is None:
            return
        self._serving.refusals.refuse(Kind.HEADER_TIMEOUT, self._client,
                                      f"h3: stream {stream_id}: headers not complete within {self._limits.header_timeout}s")
        try:
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)
        except Exception as exc:  # already ended
            log.debug("h3: could not reset stream %d: %s", stream_id, exc)
        self.transmit()

    def _on_reset(self, stream_id: int) -> None:
        """The client cancelled a request (RFC 9114 4.1.1: RESET_STREAM and/or STOP_SENDING;
        aioquic reports no reset of a request whose body had already ended, STOP_SENDING it
        does). Before its answer that counts towards the rapid-reset budget. Our side of the
        stream is reset too, so that QUIC frees it (and gives the client its stream credit
        back) instead of keeping it until the connection ends."""
        owed = stream_id in self._tasks or self._pending.get(stream_id) is not None
        self._headers_arrived(stream_id)
        self._pending.take(stream_id)
        task = self._tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()
        if owed:
            try:
                self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            except Exception as exc:  # already reset or ended
                log.debug("h3: could not reset stream %d: %s", stream_id, exc)
            self._count_early_reset(stream_id, "reset by the client before its answer")

    def _calm_down(self, kind: str, detail: str) -> None:
        """End the connection with H3_EXCESSIVE_LOAD and refuse the client for a while."""
        if self._closing:
            return
        self._serving.refusals.refuse(kind, self._client, f"h3: {detail}")
        self._serving.calm_down(self.caller)
        self._closing = True
        for task in self._tasks.values():
            task.cancel()
        self._close(ErrorCode.H3_EXCESSIVE_LOAD, kind)

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: STOP_SENDING, 408."""
        self._serving.refusals.refuse(Kind.BODY_TIMEOUT, self._client,
                                      f"h3: stream {stream_id} -> 408: body not complete within "
                                      f"{self._limits.body_timeout}s")
        try:
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        except Exception as exc:  # the stream ended meanwhile
            log.debug("h3: could not stop stream %d: %s", stream_id, exc)
        self._write(stream_id, body_timeout_response(self._limits.body_timeout), head=False)

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport; stop the client's upload (RFC 9114 4.1.1: H3_NO_ERROR)."""
        self._pending.take(stream_id)
        kind = {413: Kind.BODY_TOO_LARGE, 415: Kind.MEDIA_TYPE, 431: Kind.HEADERS_TOO_LARGE}.get(problem.status)
        if kind is not None:
            self._serving.refusals.refuse(kind, self._client, f"h3: stream {stream_id} -> {problem.status} {problem.detail}")
        else:
            log.info("h3: stream %d from %s -> %d %s", stream_id, self.caller, problem.status, problem.detail)
        if not request_complete:
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        self._write(stream_id, problem_response(problem), head=False)
        self._count_refused(stream_id, problem.status)

    def _start(self, stream_id: int, incoming: IncomingRequest) -> None:
        request = incoming.finish(self.caller)
        self._tasks[stream_id] = self._serving.spawn(self._answer(stream_id, request, incoming.head), self._loop)

    async def _answer(self, stream_id: int, request: Request, head: bool) -> None:
        task = asyncio.current_task(self._loop)   # the loop given: no getpid() (Python 3.11)
        try:
            timeout = self._limits.handler_timeout
            response = await respond_to(self._serving.handler, request,
                                        self._handler_limits.timeout(task, timeout), timeout)
            if stream_id in self._tasks:  # not reset meanwhile
                self._write(stream_id, response, head)
                self._count_refused(stream_id, response.status)
        finally:
            if self._tasks.get(stream_id) is task:
                del self._tasks[stream_id]
            if self._closing and not self._tasks:
                self._close(ErrorCode.H3_NO_ERROR, "server stopping")

    def _write(self, stream_id: int, response: Response, head: bool) -> None:
        assert self._h3 is not None
        no_content = head or not response.body
        try:
            # aioquic queues the bytes and paces them by QUIC flow control, which covers the
            # HEADERS frame too: a response without content can stall as well
            if no_content:
                self._h3.send_headers(stream_id, response_headers(response), end_stream=True)
            else:
                self._h3.send_message(stream_id, response_headers(response), response.body)
        except Exception as exc:  # stream already reset or connection closed: nothing to answer
            log.debug("h3: could not answer stream %d: %s", stream_id, exc)
        self._written.append(stream_id)
        self.transmit_data(alone=len(self._tasks) <= 1)   # with the other answers of this turn

    def answer_pending(self) -> bool:
        return bool(self._tasks)

    def transmit(self) -> None:
        super().transmit()
        if self._written:
            written, self._written = self._written, []
            streams = self._quic._streams  # private in aioquic 1.7.2
            for stream_id in written:
                stream = streams.get(stream_id)
                if stream is not None and not stream.sender.buffer_is_empty:   # not all sent at once: watch it
                    self._loop.call_later(self._limits.send_timeout, self._check_sent, stream_id)

    def _check_sent(self, stream_id: int) -> None:
        """A response still not delivered `send_timeout` after it was queued (the client gives
        no flow-control credit): reset the stream, freeing what it holds."""
        stream = self._quic._streams.get(stream_id)  # private in aioquic 1.7.2; None once done
        if stream is None or stream.sender.is_finished or self._quic._close_event is not None:
            return
        self._serving.refusals.refuse(Kind.FLOW_STALLED, self._client,
                                      f"h3: stream {stream_id}: not delivered within {self._limits.send_timeout}s")
        try:
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        except Exception as exc:
            log.debug("h3: could not reset stream %d: %s", stream_id, exc)
        self.transmit()

    # ---- closing -------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._tasks or self._pending)

    def goaway(self) -> None:
        """Refuse new requests; close once the in-flight ones are answered."""
        self._closing = True
        if not self._tasks:
            self._close(ErrorCode.H3_NO_ERROR, "server stopping")

    def abort(self) -> None:
        self._close(ErrorCode.H3_NO_ERROR, "server stopped")

    def _close(self, code: int, reason: str) -> None:
        if self._transmit_task is not None:   # answers written this turn leave before the close
            self.transmit()
        self._quic.close(error_code=code, reason_phrase=reason)
        self.transmit()

    def _peer(self) -> object:
        return self._quic._network_paths[0].addr if self._quic._network_paths else None
