"""HTTP/2 (RFC 9113) on ngh2's public API (libnghttp2), held to the limits against hostile
clients.

`H2ServerProtocol` takes a connection from listener_h2.py once its TLS handshake is done and
runs it through the request lifecycle (lifecycle.py). libnghttp2 checks each message (RFC
9113 8.1.1 and 8.2: a malformed one, content-length mismatches included, is a stream error
it resets on its own), returns flow-control credit and keeps no memory of closed streams.
A stream over SETTINGS_MAX_CONCURRENT_STREAMS is refused alone (REFUSED_STREAM, RFC 9113
5.1.2; libnghttp2 makes it a connection error): the limit is advertised in a SETTINGS frame
of our own, whose acknowledgement `FrameEdges` takes out of the input, and enforced here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import ngh2

from .exchange import response_headers
from .h2base import ErrorCodes, H2Endpoint, Setting, error_name, goaway_frame, settings_frame
from .http import Response
from .lifecycle import RequestLifecycle, Serving
from .refusals import Kind, log

DISCARD_LIMIT = 4 << 20  # bytes of a refused upload read and dropped before resetting the stream
_PREFACE_SIZE = 24   # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_BLOCK_STARTS, _CONTINUATION, _END_HEADERS = frozenset({0x1, 0x5}), 0x9, 0x4
_SETTINGS, _ACK = 0x4, 0x1
_OUR_SETTINGS_ACK = bytes((0, 0, 0, _SETTINGS, _ACK, 0, 0, 0, 0))


class FrameEdges:
    """Where a peer's frames begin and end (RFC 9113 4.1: a 9-octet header whose first three
    octets are the payload length): `partial` while the preface, a frame, or a header block
    still awaiting its CONTINUATION is incomplete. `feed` passes the input on less the
    peer's first SETTINGS acknowledgement, which answers our own SETTINGS frame (sent first,
    and acknowledged in order, RFC 9113 6.5.3): libnghttp2 did not send that frame, and an
    acknowledgement it does not expect is a connection error to it. `oversized`: a header
    block's frames came to more than `max_block` octets (encoded, a header list is no longer
    than decoded: over the decode budget for sure, refused before libnghttp2 decodes it)."""

    def __init__(self, max_block: int) -> None:
        self._skip = _PREFACE_SIZE   # octets of the current frame (or the preface) still to come
        self._head = b""             # a frame header begun
        self._in_block = False
        self._block = 0              # octets of the current header block's frames
        self._max_block = max_block
        self.oversized = False
        self._acked = False          # our SETTINGS frame's acknowledgement came (and was taken out)

    @property
    def partial(self) -> bool:
        return bool(self._skip or self._head or self._in_block)

    def feed(self, data: bytes) -> bytes:
        """`data` as libnghttp2 is to read it (a frame header begun is held back until whole
        while the acknowledgement is still to come)."""
        if not self._acked and self._head:
            data, self._head = self._head + data, b""
        at, size, cut = 0, len(data), -1
        while at < size:
            if self._skip:
                taken = min(self._skip, size - at)
                self._skip -= taken
                at += taken
                continue
            head = self._head + data[at:at + 9 - len(self._head)]
            if len(head) < 9:
                self._head = head
                if not self._acked:
                    data = data[:at]
                break
            at += 9 - len(self._head)
            self._head = b""
            self._skip = int.from_bytes(head[:3], "big")
            if head[3] in _BLOCK_STARTS or head[3] == _CONTINUATION:
                self._block = self._skip + (self._block if head[3] == _CONTINUATION else 0)
                self.oversized = self.oversized or self._block > self._max_block
                self._in_block = not head[4] & _END_HEADERS
            elif not self._acked and head == _OUR_SETTINGS_ACK:
                self._acked, cut = True, at - 9
        return data if cut < 0 else data[:cut] + data[cut + 9:]


class H2ServerProtocol(RequestLifecycle, H2Endpoint):
    """One authenticated HTTP/2 connection."""

    PROTOCOL = "h2"
    MALFORMED = ErrorCodes.PROTOCOL_ERROR
    UNPROCESSED = ErrorCodes.REFUSED_STREAM   # RFC 9113 8.7: safe to retry

    def __init__(self, serving: Serving, peer: object):
        RequestLifecycle.__init__(self, serving)
        # The advertised header list size is enforced per request (431, the connection goes
        # on); libnghttp2 itself stops far above it (a connection error: ENHANCE_YOUR_CALM).
        budget = max(4 * serving.limits.max_header_list, 1 << 16)
        H2Endpoint.__init__(self, ngh2.Connection(ngh2.Role.SERVER, ngh2.Configuration(
            max_inbound_header_list_size=budget)))
        self._peer = peer
        self._edges = FrameEdges(budget)
        self._streams: set[int] = set()   # open streams, as libnghttp2 counts them
        self._explained: set[int] = set()   # streams reset (with an error) by the client or by us
        self._discarding: dict[int, int] = {}  # refused uploads still arriving -> bytes still allowed
        self._idle_timer: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        self._last_stream = 0
        self._preface_seen = self._peer_left = False
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
        ours = settings_frame({Setting.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams})
        self._conn.initiate_connection({Setting.MAX_HEADER_LIST_SIZE: limits.max_header_list, Setting.ENABLE_PUSH: 0})
        if refusal is not None:
            code = ErrorCodes.NO_ERROR if refusal == Kind.CONNECTIONS else ErrorCodes.ENHANCE_YOUR_CALM
            transport.write(ours)
            self._goaway_and_close(code, self._refusal.encode())
            return
        transport.write(ours + self._conn.data_to_send())
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
        if self._transport.is_closing():
            return
        data = self._edges.feed(data)
        if self._edges.oversized:
            self._connection_error(True, "a header block's frames over the decode budget")
            return
        try:
            self._conn.receive_data(data)
        except ngh2.NGH2Error as exc:   # input past a limit of ours: libnghttp2 stopped
            self._connection_error(isinstance(exc, ngh2.DenialOfServiceError), str(exc))
            return
        events = self._conn.events()
        self._preface_seen = self._preface_seen or bool(events)
        self._on_events(events)
        self.transmit()
        self._on_events(self._conn.events())   # what sending ended: streams, a connection error's GOAWAY
        if self._header_timer is not None or self._edges.partial:
            self._arm_header_timer()

    def _connection_error(self, too_large: bool, detail: str) -> None:
        """The input broke a limit (libnghttp2, where it raised, sends nothing more): GOAWAY of
        our own; `too_large`: a header block far over the advertised size, which costs a decode
        budget each time, so the client may not send another at once (calm_penalty_s)."""
        self._count_refusal(Kind.HEADERS_TOO_LARGE if too_large else Kind.PROTOCOL, f"connection error: {detail}")
        if too_large:
            self._serving.calm_down(self.caller)
        code = ErrorCodes.ENHANCE_YOUR_CALM if too_large else ErrorCodes.PROTOCOL_ERROR
        self._closing = True
        self._transport.write(goaway_frame(self._last_stream, code, detail.encode()[:256]))
        self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._connection_over()
        self._window_open.set()
        for timer in (self._idle_timer, self._header_timer):
            if timer is not None:
                timer.cancel()
        log.debug("h2: connection from %s (%s) closed%s", self._peer, self.caller, f": {exc}" if exc else "")

    # ---- libnghttp2's events -------------------------------------------------------------
    def _on_events(self, events: list) -> None:
        index, count = 0, len(events)
        while index < count and not self._transport.is_closing():
            event = events[index]
            index += 1
            kind = type(event)
            if kind is ngh2.RequestReceived:
                body = events[index] if index < count else None
                if (not event.end_stream and type(body) is ngh2.DataReceived
                        and body.stream_id == event.stream_id and body.end_stream):
                    index += 1   # a whole request: its body is known with its headers
                    self._on_request(event, body.data)
                else:
                    self._on_request(event, None)
            elif kind is ngh2.DataReceived:
                stream_id = event.stream_id
                if stream_id in self._discarding:
                    self._discard(stream_id, len(event.data), event.end_stream)
                else:
                    self._on_body(stream_id, event.data, event.end_stream)
            elif kind is ngh2.StreamClosed:
                self._on_closed(event)
            else:
                self._on_event(event)

    def _on_request(self, event: ngh2.RequestReceived, body: bytes | None) -> None:
        stream_id = event.stream_id
        self._last_activity = self._loop.time()
        self._last_stream = stream_id
        limit = self._limits.max_concurrent_streams
        if len(self._streams) >= limit:   # over the limit we advertised (libnghttp2's is open)
            self._reset(stream_id, ErrorCodes.REFUSED_STREAM)
            self._stream_refused(stream_id, Kind.STREAM_LIMIT, f"over max_concurrent_streams={limit}")
            return
        self._streams.add(stream_id)
        self._on_headers(stream_id, event.headers, event.end_stream, body)

    def _on_closed(self, event: ngh2.StreamClosed) -> None:
        """A stream's end, whoever ended it: one with an error neither the client nor we
        gave is a stream error of libnghttp2's (a malformed request, RFC 9113 8.1.1)."""
        stream_id = event.stream_id
        self._streams.discard(stream_id)
        self._discarding.pop(stream_id, None)
        if event.error_code and stream_id not in self._explained:
            self._drop_stream(stream_id)
            reason = event.local_error or f"{error_name(event.error_code)} from libnghttp2"
            self._stream_refused(stream_id, Kind.MALFORMED, str(reason))
        self._explained.discard(stream_id)

    def _on_event(self, event: ngh2.Event) -> None:
        kind = type(event)
        if kind is ngh2.TrailersReceived:
            self._discarding.pop(event.stream_id, None)
            self._on_body(event.stream_id, b"", True)   # a request ended by its trailers
        elif kind is ngh2.StreamReset:
            self._explained.add(event.stream_id)
            self._discarding.pop(event.stream_id, None)
            self._on_reset(event.stream_id)
        elif kind is ngh2.WindowUpdated or kind is ngh2.SettingsReceived:
            self._window_open.set()
        elif kind is ngh2.GoAwayReceived:
            log.info("h2: %s (%s) sent GOAWAY (%s)", self._peer, self.caller, error_name(event.error_code))
            self._peer_left = True
            self.goaway()
        elif kind is ngh2.ConnectionClosed:
            if event.error_code and not self._peer_left:   # a connection error libnghttp2 found
                self._count_refusal(Kind.PROTOCOL, f"connection error: {error_name(event.error_code)} "
                                    f"{event.debug_data.decode('latin-1')}")
            self._closing = True
            self.transmit()
            self._transport.close()

    def _reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM `code` on `stream_id`, written now; one with an error is ours, not a
        malformed request's (`_on_closed`)."""
        if code:
            self._explained.add(stream_id)
        with contextlib.suppress(ngh2.NGH2Error):
            self._conn.reset_stream(stream_id, code)
        self.transmit()

    def _discard(self, stream_id: int, size: int, ended: bool) -> None:
        """RFC 9113 8.1 lets a server cut an upload off with RST_STREAM(NO_ERROR) after a
        complete response, but httpx/httpcore then waits for flow-control credit that never
        comes instead of reading the answer. So the rest of a refused upload is read and
        dropped (never stored) up to DISCARD_LIMIT bytes, and only a longer one is reset."""
        budget = self._discarding[stream_id] - size
        if budget >= 0 and not ended:
            self._discarding[stream_id] = budget
            return
        del self._discarding[stream_id]
        if budget < 0:
            self._reset(stream_id, ErrorCodes.NO_ERROR)

    # ---- the wire operations of the lifecycle --------------------------------------------
    def _write_answer(self, stream_id: int, response: Response, head: bool) -> Awaitable[None] | None:
        body = b"" if head else response.body
        try:
            self._conn.send_response(stream_id, response_headers(response), end_stream=not body)
            if body:
                self._conn.send_data(stream_id, body, end_stream=True)
            waits = bool(body) and not self._fits(stream_id, len(body))
        except ngh2.NGH2Error as exc:   # the stream was reset or closed meanwhile
            log.debug("h2: could not answer stream %d: %s", stream_id, exc)
            return None
        if waits:
            return self._send_rest_of_answer(stream_id)
        self._send_answers()
        return None

    async def _send_rest_of_answer(self, stream_id: int) -> None:
        """The content as flow control allows; one that gets no credit for `send_timeout` is
        cut off (RST_STREAM CANCEL)."""
        if await self._sent(stream_id, self._limits.send_timeout) == "stalled":
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
