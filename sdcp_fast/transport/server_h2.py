"""HTTP/2 (RFC 9113) on jh2's public API, held to the limits against hostile clients.

`H2ServerProtocol` takes a connection from listener_h2.py once its TLS handshake is done and
runs it through the request lifecycle (lifecycle.py); compat.H2StreamErrors keeps the
content-length cases h2 checks stream errors. A stream over SETTINGS_MAX_CONCURRENT_STREAMS
is refused alone (REFUSED_STREAM, RFC 9113 5.1.2: h2 would make it a connection error, so
the limit is advertised in a SETTINGS frame of our own and enforced here).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import jh2.events
import jh2.exceptions
import jh2.hyperframe.frame
import jh2.settings

from .compat import H2StreamErrors, MalformedStream
from .exchange import response_headers
from .h2base import ErrorCodes, H2Endpoint, configuration
from .http import Response
from .lifecycle import RequestLifecycle, Serving
from .refusals import Kind, log

DISCARD_LIMIT = 4 << 20  # bytes of a refused upload read and dropped before resetting the stream
_PREFACE_SIZE = 24   # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_BLOCK_STARTS, _CONTINUATION, _END_HEADERS = frozenset({0x1, 0x5}), 0x9, 0x4


class FrameEdges:
    """Where a peer's frames begin and end (RFC 9113 4.1: a 9-octet header whose first three
    octets are the payload length): `partial` while the preface, a frame, or a header block
    still awaiting its CONTINUATION is incomplete."""

    def __init__(self) -> None:
        self._skip = _PREFACE_SIZE   # octets of the current frame (or the preface) still to come
        self._head = b""             # a frame header begun
        self._in_block = False

    @property
    def partial(self) -> bool:
        return bool(self._skip or self._head or self._in_block)

    def feed(self, data: bytes) -> None:
        at, size = 0, len(data)
        while at < size:
            if self._skip:
                taken = min(self._skip, size - at)
                self._skip -= taken
                at += taken
                continue
            head = self._head + data[at:at + 9 - len(self._head)]
            at += len(head) - len(self._head)
            if len(head) < 9:
                self._head = head
                return
            self._head = b""
            self._skip = int.from_bytes(head[:3], "big")
            if head[3] in _BLOCK_STARTS or head[3] == _CONTINUATION:
                self._in_block = not head[4] & _END_HEADERS


class H2ServerProtocol(RequestLifecycle, H2Endpoint):
    """One authenticated HTTP/2 connection."""

    PROTOCOL = "h2"
    MALFORMED = ErrorCodes.PROTOCOL_ERROR
    UNPROCESSED = ErrorCodes.REFUSED_STREAM   # RFC 9113 8.7: safe to retry

    def __init__(self, serving: Serving, peer: object):
        RequestLifecycle.__init__(self, serving)
        H2Endpoint.__init__(self, H2StreamErrors(configuration(client_side=False)))
        self._peer = peer
        self._edges = FrameEdges()
        self._discarding: dict[int, int] = {}  # refused uploads still arriving -> bytes still allowed
        self._idle_timer: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        self._preface_seen = False
        # Bytes decrypted together with the client's Finished reach data_received before
        # start() has checked the certificate: keep them (bounded).
        self._early: list[bytes] = []

    # ---- admission -----------------------------------------------------------------------
    def start(self, transport: asyncio.Transport) -> None:
        """Called by TLSAcceptor once the handshake is done: check the certificate, admit."""
        self._transport = transport
        serving, limits = self._serving, self._limits
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            serving.refusals.refuse(Kind.ALPN, self._peer, "TLS done without ALPN h2")
            transport.abort()
            return
        refusal = self._admit(ssl_object.getpeercert(binary_form=True), serving.certificates.check_der)
        if refusal == Kind.CERTIFICATE:
            transport.abort()
            return
        codes = jh2.settings.SettingCodes
        self._conn.local_settings = jh2.settings.Settings(client=False, initial_values={
            codes.MAX_HEADER_LIST_SIZE: limits.max_header_list, codes.ENABLE_PUSH: 0})
        # The advertised size is enforced per request (431, the connection goes on); HPACK
        # itself stops decoding far above it (a connection error: ENHANCE_YOUR_CALM).
        self._conn.decoder.max_header_list_size = max(4 * limits.max_header_list, 1 << 16)
        self._conn.initiate_connection()
        if refusal is not None:
            code = ErrorCodes.NO_ERROR if refusal == Kind.CONNECTIONS else ErrorCodes.ENHANCE_YOUR_CALM
            self._goaway_and_close(code, self._refusal.encode())
            return
        limit = jh2.hyperframe.frame.SettingsFrame(0, settings={codes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams})
        transport.write(self._conn.data_to_send() + limit.serialize())
        self._last_activity = self._loop.time()
        self._idle_timer = self._loop.call_later(limits.idle_timeout, self._idle_check)
        self._arm_header_timer()
        early, self._early = b"".join(self._early), []
        if early:
            self.data_received(early)

    # ---- asyncio.Protocol (connection_made is asyncio's no-op: TLSAcceptor calls start()) ----
    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            if self._transport is None and sum(map(len, self._early)) + len(data) <= 1 << 20:
                self._early.append(data)
            return
        self._edges.feed(data)
        try:
            events = self._conn.receive_data(data)
            self._preface_seen = self._preface_seen or bool(events)
        except jh2.exceptions.ProtocolError as exc:
            kind = Kind.HEADERS_TOO_LARGE if isinstance(exc, jh2.exceptions.DenialOfServiceError) else Kind.PROTOCOL
            self._count_refusal(kind, f"connection error: {exc}")
            if kind == Kind.HEADERS_TOO_LARGE:
                # a header block far over the advertised size: HPACK decoded a full budget
                # of it before giving up, which a client must not get again at once
                self._serving.calm_down(self.caller)
            self.transmit()  # h2 has queued a GOAWAY
            self._transport.close()
            return
        index, count = 0, len(events)
        while index < count and not self._transport.is_closing():
            event = events[index]
            index += 1
            if isinstance(event, jh2.events.RequestReceived):
                body = events[index] if index < count else None
                if (event.stream_ended is None and isinstance(body, jh2.events.DataReceived)
                        and body.stream_id == event.stream_id and body.stream_ended is not None):
                    index += 1   # a whole request: its body is known with its headers
                    self._on_request(event, body)
                else:
                    self._on_request(event, None)
            else:
                self._on_event(event)
        self.transmit()
        if self._header_timer is not None or self._edges.partial:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._connection_over()
        self._window_open.set()
        self._writable.set()
        for timer in (self._idle_timer, self._header_timer):
            if timer is not None:
                timer.cancel()
        log.debug("h2: connection from %s (%s) closed%s", self._peer, self.caller, f": {exc}" if exc else "")

    # ---- h2 events -----------------------------------------------------------------------
    def _on_request(self, event: jh2.events.RequestReceived, data: jh2.events.DataReceived | None) -> None:
        stream_id = event.stream_id
        self._last_activity = self._loop.time()
        if data is not None:   # credit is returned whatever happens to the bytes
            self._credit(data)
        limit = self._limits.max_concurrent_streams
        if len(self._conn.streams) > limit and self._conn.open_inbound_streams > limit and sum(
                1 for other, stream in self._conn.streams.items() if other <= stream_id and stream.open) > limit:
            # over the limit when it opened: streams open later in this read have higher ids
            with contextlib.suppress(jh2.exceptions.H2Error):
                self._conn.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            self._stream_refused(stream_id, Kind.STREAM_LIMIT, f"over max_concurrent_streams={limit}")
            return
        self._on_headers(stream_id, event.headers, event.stream_ended is not None,
                         None if data is None else data.data)

    def _on_event(self, event: jh2.events.Event) -> None:
        if isinstance(event, jh2.events.DataReceived):
            stream_id = event.stream_id
            self._credit(event)
            if stream_id in self._discarding:
                self._discard(stream_id, len(event.data))
            else:
                self._on_body(stream_id, event.data, event.stream_ended is not None)
        elif isinstance(event, jh2.events.StreamEnded):
            self._discarding.pop(event.stream_id, None)
            self._on_body(event.stream_id, b"", True)   # a request ended by its trailers
        elif isinstance(event, jh2.events.StreamReset):
            self._discarding.pop(event.stream_id, None)
            self._on_reset(event.stream_id)
        elif isinstance(event, MalformedStream):
            if event.flow_controlled_length:
                self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self._drop_stream(event.stream_id)
            self._stream_refused(event.stream_id, Kind.MALFORMED, event.reason)
        elif isinstance(event, jh2.events.WindowUpdated | jh2.events.RemoteSettingsChanged):
            self._window_open.set()
        elif isinstance(event, jh2.events.ConnectionTerminated):
            log.info("h2: %s (%s) sent GOAWAY (%s)", self._peer, self.caller, event.error_code)
            self.goaway()

    def _discard(self, stream_id: int, size: int) -> None:
        """RFC 9113 8.1 lets a server cut an upload off with RST_STREAM(NO_ERROR) after a
        complete response, but httpx/httpcore then waits for flow-control credit that never
        comes instead of reading the answer. So the rest of a refused upload is read and
        dropped (never stored) up to DISCARD_LIMIT bytes, and only a longer one is reset."""
        budget = self._discarding[stream_id] - size
        if budget >= 0:
            self._discarding[stream_id] = budget
            return
        del self._discarding[stream_id]
        self._reset(stream_id, ErrorCodes.NO_ERROR)

    # ---- the wire operations of the lifecycle --------------------------------------------
    def _write_answer(self, stream_id: int, response: Response, head: bool) -> Awaitable[None] | None:
        try:
            rest = self._send_message(stream_id, response_headers(response), b"" if head else response.body)
        except jh2.exceptions.H2Error as exc:   # the stream was reset or forgotten meanwhile
            log.debug("h2: could not answer stream %d: %s", stream_id, exc)
            return None
        if rest:
            return self._send_rest_of_answer(stream_id, rest)
        self._send_answers()
        return None

    async def _send_rest_of_answer(self, stream_id: int, rest: bytes) -> None:
        """The content as flow control allows; one that gets no credit for `send_timeout` is
        cut off (RST_STREAM CANCEL)."""
        if await self._send_rest(stream_id, rest, self._limits.send_timeout) == "stalled":
            self._count_refusal(Kind.FLOW_STALLED,
                                f"stream {stream_id}: no flow-control credit for {self._limits.send_timeout}s")
            self._reset(stream_id, ErrorCodes.CANCEL)

    def _stop_upload(self, stream_id: int, overdue: bool) -> None:
        if overdue:   # the answer is complete: end the stream (RFC 9113 8.1)
            self._reset(stream_id, ErrorCodes.NO_ERROR)
        else:
            self._discarding[stream_id] = DISCARD_LIMIT

    def _end_connection(self, kind: str) -> None:
        if kind == "calm":
            self._goaway_and_close(ErrorCodes.ENHANCE_YOUR_CALM, self._calm_reason.encode())
        else:
            self._goaway_and_close()

    # ---- housekeeping --------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        """The client preface, and any frame once begun, must arrive whole within
        header_timeout (a client that trickles a header block would hold the connection,
        which accepts nothing else until the block ends)."""
        waiting = self._edges.partial
        if waiting and self._header_timer is None:
            self._header_timer = self._loop.call_later(self._limits.header_timeout, self._header_overdue)
        elif not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_overdue(self) -> None:
        self._header_timer = None
        if not self._edges.partial:
            return
        what = "a frame" if self._preface_seen else "the client preface"
        self._count_refusal(Kind.HEADER_TIMEOUT, f"{what} not complete within {self._limits.header_timeout}s")
        self._closing = True
        self._transport.close()

    def _idle_check(self) -> None:
        """Idle means no stream: bytes alone (PINGs, a trickled frame) do not keep a
        connection open. One timer per connection, re-armed only when it fires (not per packet)."""
        idle_for = self._loop.time() - self._last_activity
        if self.busy or idle_for < self._limits.idle_timeout:
            remaining = self._limits.idle_timeout - idle_for
            self._idle_timer = self._loop.call_later(max(remaining, 0.05), self._idle_check)
            return
        self._count_refusal(Kind.IDLE, f"idle for {self._limits.idle_timeout}s: closing")
        self.goaway()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
