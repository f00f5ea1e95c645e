"""Fewer datagrams per HTTP/3 request: what our aioquic client and server add to aioquic's defaults.

With aioquic 1.7.2 as it comes, one SDCP round (a request, its answer ~1 ms later) took six
datagrams, three each way, each encrypted, sent, woken for, decrypted and parsed in Python:
  - the request (or the answer) itself;
  - a QPACK decoder-stream packet: with the dynamic table on (aioquic advertises 4096 bytes),
    every header block the peer encoded against the table is acknowledged on the decoder
    stream (RFC 9204 4.4.1), in a packet of its own right after the block arrives;
  - an ACK-only packet: aioquic acknowledges 1 ms (`K_GRANULARITY`) after the first
    ack-eliciting packet and puts an ACK into a packet only once it is due, so an answer
    sent 0.3 ms after its request does not carry the ACK, and the timer then sends it alone
    (and wakes the process for it) unless the answer took longer than 1 ms.
Each of those costs CPU per unit of time rather than per byte, which is why a lone session
cost the verifier 2.5x the CPU of HTTP/2 per proposal while 32 sessions (whose packets share
datagrams and ACKs) did not.

What changes here, per connection, nothing global; no frame is sent that RFC 9000/9114/9204
does not describe, and every SDCP message is the same bytes:
  - `LeanH3`: the QPACK dynamic table is off in both directions (SETTINGS advertise a table
    capacity and blocked streams of 0, RFC 9204 3.2.3), so header blocks use the static table
    and literals (a few dozen bytes more per block) and no decoder/encoder-stream packets.
  - `LeanAcks`: an owed ACK rides on the next packet that carries data (`ack_with_data`,
    called where we send a request or an answer), and is otherwise sent `ACK_DELAY` after
    the first unacknowledged packet (within the max_ack_delay of 25 ms that aioquic
    announces), or at once when a second datagram arrives while one is owed and we sent no
    data since the first (RFC 9000 13.2.2: at least every second ack-eliciting packet), so
    that a sender of many packets is not held back by its congestion window. In an exchange
    (data sent since the first, the peer's datagrams less than `QUICK_PEER` apart) the ACK of
    a lone datagram waits for the next, at most `LONE_ACK_DELAY`, and the ACK of both rides
    on the next data: a session's requests and answers carry an ACK every second packet each
    way, each ACK frame built and processed (aioquic's loss recovery) for two packets.
  - `LeanAcks.transmit_data`: while other requests are in flight on the connection, what is
    written during one event-loop turn leaves in one call to `transmit()` at the end of it
    (the answers completed by one batch share datagrams); a lone request leaves at once.
  - `LeanAcks.datagram_received`: what a received datagram leads to is sent at the end of
    the loop turn (`_transmit_soon`), not at once, unless an ACK became due (a second
    datagram while one is owed): on the drafter the answer's datagram and the next request
    then cost one `transmit()` (building packets, re-arming the timer), not two, and the
    datagrams one turn reads share one.
  - `LeanAcks.answer_pending` (the server's hook): while a request is being answered on the
    connection, what a received datagram leads to (its ACK, flow-control credit) waits for
    the answer's datagram, at most `ANSWER_WAIT`, instead of a `transmit()` of its own at the
    end of the loop turn. On a lone session's verifier that `transmit()` sent nothing (the
    ACK was not due yet) and still cost aioquic a packet built and dropped, about a fifth of
    the verifier's HTTP/3 work per round, on the round's critical path.
  - `LeanAcks.transmit`: aioquic's loop timer (ACK, loss detection, idle) is re-armed only
    when it must fire earlier than the armed one; fired too early, it re-arms for the later
    deadline instead of acting. aioquic cancelled and armed one every round at each end: the
    loss-detection deadline moves later with every packet sent. On the client, whose UDP
    socket is connected to its server, datagrams are sent without an address.
  - `LeanH3`: a whole message in one piece of stream data (HEADERS, then one DATA frame
    ending the stream: every SDCP request and answer) is read without aioquic's frame loop,
    with the same checks, states, events and refusals; a final HEADERS frame is coded once
    per connection and header list once the peer's SETTINGS allow no QPACK table, and a header
    block read is decoded and checked once per connection (with no table, the same bytes give
    the same list); request
    streams are looked up in line (aioquic's generator-based context manager costs about
    six calls each time). `LeanAcks._process_events`: stream data skips aioquic's five
    event-type tests.

Below HTTP/3, quic_packets.LeanQuic writes and reads the 1-RTT packets themselves with less of
aioquic's generality (no empty packet after the last, no full header parse per datagram).

These reach into aioquic's private state (`_ack_delay`, `_spaces`, `_transmit_soon`, `_timer`,
`_events`, `_stream`, `_received_settings`; the server's `_protocols` and `_configuration` in
server_h3.H3Server):
quic_mtls.check_aioquic() refuses an unreviewed aioquic version, and it checks these names.
"""

from __future__ import annotations

import logging

import pylsqpack
from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import (
    FrameType,
    FrameUnexpected,
    H3Connection,
    H3Stream,
    HeadersState,
    QpackDecompressionFailed,
    Setting,
    encode_frame,
    is_interim_response,
    validate_request_headers,
    validate_response_headers,
)
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.events import StreamDataReceived

from .quic_packets import LeanQuic

ACK_DELAY = 0.010   # s: longer than a round at the other end, well within max_ack_delay (25 ms)
ANSWER_WAIT = 0.005  # s: how long what a request leads to may wait for its answer's datagram
LONE_ACK_DELAY = 0.020  # s: how long a lone datagram's ACK may wait for the peer's next (max_ack_delay: 25 ms)
QUICK_PEER = 0.005      # s: a lone ACK waits only while the peer's datagrams follow each other within this
log = logging.getLogger(__name__)


class LeanH3(H3Connection):
    """aioquic's H3Connection with the QPACK dynamic table off in both directions."""

    def __init__(self, quic, **kwargs):
        super().__init__(quic, **kwargs)
        # the SETTINGS frame (queued by super().__init__) already said 0: decode accordingly
        self._max_table_capacity = self._blocked_streams = 0
        self._decoder = pylsqpack.Decoder(0, 0)
        self._header_frames: dict[tuple, bytes] = {}
        self._header_blocks: dict[bytes, tuple] = {}

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings[Setting.QPACK_MAX_TABLE_CAPACITY] = 0
        settings[Setting.QPACK_BLOCKED_STREAMS] = 0
        return settings

    # With the table off neither QPACK side ever has encoder or decoder-stream bytes to send:
    # aioquic writes them regardless, an empty write (a stream lookup, no frame) per header
    # block; these two are aioquic's, less that write when there is nothing to write.
    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> list[tuple[bytes, bytes]]:
        try:
            if frame_data is None:
                decoder, headers = self._decoder.resume_header(stream_id)
            else:
                decoder, headers = self._decoder.feed_header(stream_id, frame_data)
            self._decoder_bytes_sent += len(decoder)
            if decoder:
                self._quic.send_stream_data(self._local_decoder_stream_id, decoder)
        except pylsqpack.DecompressionFailed as exc:
            raise QpackDecompressionFailed() from exc
        return headers

    def _encode_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        encoder, frame_data = self._encoder.encode(stream_id, headers)
        self._encoder_bytes_sent += len(encoder)
        if encoder:
            self._quic.send_stream_data(self._local_encoder_stream_id, encoder)
        return frame_data

    # The largest HEADERS frame read whole by `_receive_request_or_push_data`; a longer one
    # takes aioquic's path (the server's limit on header blocks is checked there).
    whole_headers_limit = 16384

    def _receive_request_or_push_data(self, stream, data: bytes, stream_ended: bool) -> list:
        """A whole message in one piece of stream data (a HEADERS frame, then one DATA frame
        that ends the stream, nothing before or after: every SDCP request and answer) is read
        here with the checks, stream states and events aioquic's frame loop would give; any
        other shape (or qlog on) goes to aioquic's loop."""
        head = data[:1]
        if head != b"\x01" or not stream_ended or stream.frame_type is not None or stream.buffer \
                or stream.blocked or stream.push_id is not None or self._quic_logger is not None \
                or stream.headers_recv_state != HeadersState.INITIAL:
            return super()._receive_request_or_push_data(stream, data, stream_ended)
        start, size = _varint(data, 1)
        end = start + size
        if start < 0 or size > self.whole_headers_limit or data[end:end + 1] != b"\x00":
            return super()._receive_request_or_push_data(stream, data, stream_ended)
        body_start, body_size = _varint(data, end + 1)
        if body_start < 0 or body_start + body_size != len(data):
            return super()._receive_request_or_push_data(stream, data, stream_ended)
        stream.receiving_ended = True
        stream_id = stream.stream_id
        block = data[start:end]
        known = self._header_blocks.get(block)
        try:
            if known is not None:   # read before on this connection: the same list, the same checks passed
                headers = list(known[0])
                if known[1] is not None:
                    stream.expected_content_length = known[1]
            else:
                headers = self._decode_headers(stream_id, block)
                if not self._is_client:
                    validate_request_headers(headers, stream)
                else:
                    interim = is_interim_response(headers)
                    validate_response_headers(headers, None if interim else stream)
                    if interim:   # a 1xx cannot be followed by DATA
                        stream.interim_response_received = True
                        raise FrameUnexpected("DATA frame is not allowed in this state")
                self._remember_header_block(block, headers, stream.expected_content_length)
            stream.headers_recv_state = HeadersState.AFTER_HEADERS
            body = data[body_start:]
            stream.content_length += body_size
            self._check_content_length(stream)
        except pylsqpack.StreamBlocked:   # as aioquic leaves a blocked HEADERS frame
            stream.blocked = True
            stream.blocked_frame_size = size
            stream.blocked_frame_type = FrameType.HEADERS
            stream.buffer = data[end:]
            return []
        except BaseException:   # a refusal leaves the stream as aioquic's loop leaves it
            stream.buffer = data
            raise
        return [HeadersReceived(headers=headers, stream_id=stream_id, stream_ended=False),
                DataReceived(data=body, stream_id=stream_id, stream_ended=True)]

    def send_message(self, stream_id: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """`send_headers(headers)` then `send_data(body, end_stream=True)`: the same HEADERS
        and DATA frames and the same checks and stream states, in one QUIC stream write (one
        stream lookup and state update instead of two of each, in aioquic's Python).
        Anything else than a first, final header block (trailers, a 1xx, qlog on) takes
        aioquic's two calls."""
        stream = self._stream.get(stream_id)
        key = tuple(headers)
        frame = self._header_frames.get(key)   # remembered: a final header block (not a 1xx)
        if (stream is not None and stream.headers_send_state != HeadersState.INITIAL) \
                or self._quic_logger is not None or (stream is None and stream_id & 2) \
                or (frame is None and not self._is_client and is_interim_response(headers)):
            self.send_headers(stream_id, headers)
            self.send_data(stream_id, body, end_stream=True)
            return
        if stream is None:   # a request stream's first use (the client's)
            stream = self._stream[stream_id] = H3Stream(stream_id)
        try:
            if stream.sending_ended:   # what send_headers' finish_sending() would refuse
                raise FrameUnexpected("stream was already ended")
            if frame is None:
                frame_data = self._encode_headers(stream_id, headers)
                frame = encode_frame(FrameType.HEADERS, frame_data)
                self._remember_header_frame(key, frame_data, frame)
            stream.headers_send_state = HeadersState.AFTER_HEADERS
            stream.finish_sending()
        finally:
            self._forget_if_ended(stream)
        self._quic.send_stream_data(stream_id, frame + encode_frame(FrameType.DATA, body), True)

    # aioquic looks a stream up (and forgets it once ended both ways) in a generator-based
    # context manager, about six Python calls each time; for request streams (bidirectional:
    # no half ended from the start) these two do the same in line
    def _receive_stream_data(self, event) -> list:
        stream_id = event.stream_id
        if stream_id & 2:   # unidirectional: aioquic's
            return super()._receive_stream_data(event)
        stream = self._stream.get(stream_id)
        if stream is None:
            stream = self._stream[stream_id] = H3Stream(stream_id)
        try:
            return self._receive_request_or_push_data(stream, event.data, event.end_stream)
        finally:
            self._forget_if_ended(stream)

    def _forget_if_ended(self, stream) -> None:
        if stream.sending_ended and stream.receiving_ended and not stream.blocked:   # H3Stream.is_ended()
            self._stream.pop(stream.stream_id, None)

    # HEADERS frames coded once per connection and header list: with the table off (ours and
    # our peers') a header block is a function of the fields alone
    REMEMBERED_HEADER_FRAMES = 64
    REMEMBERED_HEADER_FRAME_SIZE = 512

    def _remember_header_frame(self, key: tuple, frame_data: bytes, frame: bytes) -> None:
        # only once the peer's SETTINGS allowed the encoder no dynamic table (ours say 0;
        # another peer's table would make a block depend on what the encoder saw before), and
        # a block that refers to no table entry (Required Insert Count 0, Base 0: its first two
        # octets, RFC 9204 4.5.1), valid whatever the table holds
        settings = self._received_settings
        if settings is None or settings.get(Setting.QPACK_MAX_TABLE_CAPACITY, 0) \
                or frame_data[:2] != b"\x00\x00" or len(frame) > self.REMEMBERED_HEADER_FRAME_SIZE:
            return
        if len(self._header_frames) >= self.REMEMBERED_HEADER_FRAMES:
            self._header_frames.clear()
        self._header_frames[key] = frame


    # Header blocks read whole, remembered per connection with what reading them found: with no
    # QPACK table on our side a block can refer to no table entry, so it decodes to the same
    # list whatever came before, and aioquic's checks of a request's or a final answer's list
    # (validate_request_headers / validate_response_headers) depend on the list alone, setting
    # only the stream's expected content-length (kept here too). A session sends the same
    # block round after round: it is decoded and checked once.
    REMEMBERED_HEADER_BLOCKS = 64
    REMEMBERED_HEADER_BLOCK_SIZE = 512

    def _remember_header_block(self, block: bytes, headers: list, content_length: int | None) -> None:
        # a block that passed the checks and refers to no table entry (Required Insert Count 0,
        # Base 0: its first two octets, RFC 9204 4.5.1); our decoder has no table (LeanH3)
        if block[:2] != b"\x00\x00" or len(block) > self.REMEMBERED_HEADER_BLOCK_SIZE \
                or self._max_table_capacity:
            return
        if len(self._header_blocks) >= self.REMEMBERED_HEADER_BLOCKS:
            self._header_blocks.clear()
        self._header_blocks[block] = (tuple(headers), content_length)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """(offset after, value) of the QUIC variable-length integer at `at` (RFC 9000 16);
    (-1, 0) when `data` ends inside it."""
    if at >= len(data):
        return -1, 0
    first = data[at]
    length = 1 << (first >> 6)
    after = at + length
    if after > len(data):
        return -1, 0
    if length == 1:
        return after, first
    return after, int.from_bytes(data[at:after], "big") & ((1 << (8 * length - 2)) - 1)


class LeanAcks(QuicConnectionProtocol):
    """aioquic's protocol with ACKs that ride on data and transmits batched per loop turn."""

    def __init__(self, quic, **kwargs):
        LeanQuic.adopt(quic)   # no empty packet after the last (quic_packets.py)
        super().__init__(quic, **kwargs)

    def lengthen_ack_delay(self) -> None:
        """Once the handshake is done (handshake ACKs are not delayed, RFC 9000 13.2.1)."""
        self._quic._ack_delay = ACK_DELAY
        self._space = self._application_space()

    def datagram_received(self, data: bytes | str, addr) -> None:
        space = self._application_space()
        owed = space is not None and space.ack_at is not None
        now = self._loop.time()
        self._gap, self._arrived = now - self._arrived, now
        if not owed:   # an ACK owed from this datagram on starts afresh
            self._owed_since = now
            self._exchanging = self._ack_ready = False
        self._quic.receive_datagram(data, addr, now=now)
        self._process_events()
        if owed and space.ack_at is not None:   # a second datagram while an ACK is owed
            if not self._exchanging:   # the peer sends, we do not (a bulk upload): ACK now
                space.ack_at = self._loop.time()
                self.transmit()
                return
            # a request and its answer, one way and the other: the ACK of both rides on the
            # next data, within ACK_DELAY of this datagram at the latest
            self._ack_ready = True
            space.ack_at = min(space.ack_at, self._loop.time() + ACK_DELAY)
        if self.answer_pending():
            # an answer is on its way: what this datagram leads to leaves with it (`transmit`),
            # or on its own after ANSWER_WAIT if the answer takes longer
            if self._transmit_task is None and self._answer_wait_until is None:
                self._answer_wait_until = self._loop.time() + ANSWER_WAIT
                if self._answer_timer is None:
                    self._answer_timer = self._loop.call_at(self._answer_wait_until, self._answer_overdue)
        else:
            # at the end of this loop turn: what the events just processed lead to (the
            # drafter's next request, written as soon as the verdict is read) leaves in the
            # same transmit, and the datagrams read in one turn share one (and one timer re-arm)
            self._transmit_soon()

    # what a datagram led to leaves by this time (loop clock) if no answer takes it first; None:
    # nothing waits. The timer that sees to it stays armed across rounds (`_answer_overdue`):
    # arming and cancelling one per request was two timer operations per round
    _answer_wait_until: float | None = None
    _answer_timer = None

    def _answer_overdue(self) -> None:
        until = self._answer_wait_until
        if until is None:   # sent meanwhile
            self._answer_timer = None
        elif until > self._loop.time():   # a later datagram's wait: fire then
            self._answer_timer = self._loop.call_at(until, self._answer_overdue)
        else:
            self._answer_timer = None
            self.transmit()

    def _process_events(self) -> None:
        """aioquic's, with stream data (nearly every event) handed on without first testing it
        against the five event types the protocol itself handles; the first other event and
        all after it go to aioquic's own loop, in order."""
        events = self._quic._events
        while events:
            if events[0].__class__ is not StreamDataReceived:
                super()._process_events()
                return
            self.quic_event_received(events.popleft())

    def answer_pending(self) -> bool:
        """Whether a request is being answered on this connection (a server's hook)."""
        return False

    def transmit(self) -> None:
        """Send what aioquic has to send, then make sure its timer (ACK, loss detection,
        idle, pacing) fires no later than it asks. Unlike aioquic's own transmit, a timer
        already armed for an earlier moment stays armed (`_handle_timer` re-arms it for the
        later moment when it fires too early): the loss-detection deadline moves later with
        every packet sent, so aioquic cancelled and re-armed a loop timer in every round."""
        self._answer_wait_until = None
        self._transmit_task = None
        quic = self._quic
        peer = self._connected_to
        send = self._transport.sendto
        for data, addr in quic.datagrams_to_send(now=self._loop.time()):
            if peer is None:
                send(data, addr)
            elif addr == peer:
                send(data)   # the transport's socket is connected to the peer: no address per send
            else:
                self._send_elsewhere(data, addr)
        timer_at = quic.get_timer()
        timer = self._timer
        if timer is not None and (timer_at is None or timer_at < self._armed_at):
            timer.cancel()
            timer = self._timer = None
        if timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
            self._armed_at = timer_at
        self._timer_at = timer_at

    _armed_at = 0.0         # when the armed timer (`_timer`) fires; `_timer_at` may be later
    _connected_to = None    # the peer's address when the transport's socket is connected to it

    def _handle_timer(self) -> None:
        timer_at = self._timer_at
        if timer_at is not None and timer_at > self._armed_at:
            # armed for a deadline that has since moved later: wait for the new one (aioquic's
            # handler would take the new deadline as the present: loss detection too early)
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
            self._armed_at = timer_at
            return
        if timer_at is None:   # nothing is due any more
            self._timer = None
            return
        super()._handle_timer()

    def _send_elsewhere(self, data: bytes, addr) -> None:
        """A datagram for another address than the connected peer's (a path probe aioquic
        may send to a server's preferred address, which our servers do not announce): the
        connected socket cannot send it, so it is dropped, as the network might."""
        log.debug("h3: datagram for %s dropped: the socket is connected to %s", addr, self._connected_to)

    def ack_with_data(self) -> None:
        """Make an owed ACK due now, so that the packet about to carry data carries it too,
        once it acknowledges two datagrams or more (RFC 9000 13.2.2: at least every second
        ack-eliciting packet). A lone datagram's ACK waits for the next: in an exchange of
        requests and answers the peer's next packet follows ours by a round, so every other
        packet each way carries an ACK (one ACK frame built and one processed per two
        packets instead of per packet) and none leaves alone; it waits at most
        LONE_ACK_DELAY after the datagram (within the max_ack_delay of 25 ms aioquic
        announces), then leaves on the timer."""
        self._exchanging = True
        space = self._application_space()
        if space is not None and space.ack_at is not None:
            if self._ack_ready or self._gap >= QUICK_PEER:
                # a second datagram, or a peer whose last datagram followed the one before by
                # QUICK_PEER or more (the ACK, waiting, might leave alone): it rides on this data
                space.ack_at = self._loop.time()
            else:
                space.ack_at = max(space.ack_at, self._owed_since + LONE_ACK_DELAY)

    _arrived = 0.0          # when the last datagram arrived
    _gap = 1.0              # how long after the one before it (s)
    _owed_since = 0.0       # when the datagram that began the owed ACK arrived
    _exchanging = False     # data sent since then: the peer's next datagram answers it
    _ack_ready = False      # the owed ACK acknowledges a second datagram: it rides on the next data

    def transmit_data(self, *, alone: bool) -> None:
        """Send what was just written, with any ACK owed: at once when nothing else is in
        flight on the connection (one session: no loop turn lost), otherwise at the end of
        this loop turn, with whatever else is written in it (the answers of one batch)."""
        self.ack_with_data()
        if alone and self._transmit_task is None:
            self.transmit()
        else:
            self._transmit_soon()

    # the 1-RTT packet space, kept once the handshake is done (a Retry or version negotiation
    # before that makes aioquic build new spaces); until then looked up in an enum-keyed dict
    # (a Python __hash__ call) every time
    _space = None

    def _application_space(self):
        space = self._space
        return space if space is not None else self._quic._spaces.get(tls.Epoch.ONE_RTT)
