"""HTTP/3 on QUIC for both ends, on aioquic's and pylsqpack's public APIs: a QuicConnection
moved by the event loop (`QuicDriver`) and the framing of RFC 9114 (`H3Streams`).

What one loop turn writes is sent by one `transmit()` at its end (`transmit_soon`), so the
packets of a batch share datagrams and ACKs; while an answer is being worked out
(`answer_pending`), what a received datagram leads to waits for it, at most ANSWER_WAIT.

Why not aioquic's H3Connection: its public API cannot keep a malformed request (RFC 9114
4.1.2) a stream error, cannot refuse a HEADERS frame over the advertised field-section size
before buffering it, and always offers a QPACK dynamic table. So, here: both ends advertise
a QPACK table of 0 and no blocked streams (RFC 9204 3.2.3; no encoder or decoder stream,
4.2); a message is one HEADERS and at most one DATA frame in one stream write; HEADERS over
`max_field_section_size` is reported as `TooLarge` once its length is read, the rest of the
stream dropped unread; a frame that breaks the framing is a connection error (`H3Error`).
"""

from __future__ import annotations

import asyncio
from collections import namedtuple
from collections.abc import Callable

import pylsqpack
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode
from aioquic.quic.connection import QuicConnection

from .exchange import BoundedMemo

ANSWER_WAIT = 0.005   # seconds a received datagram's transmit may wait for an answer's
DATA, HEADERS, SETTINGS, GOAWAY = 0x0, 0x1, 0x4, 0x7
_CONTROL_FRAMES = frozenset({0x3, SETTINGS, 0x5, GOAWAY, 0xD})   # never on a request stream
CONTROL_STREAM = 0x0
QPACK_MAX_TABLE_CAPACITY, MAX_FIELD_SECTION_SIZE, QPACK_BLOCKED_STREAMS = 0x1, 0x6, 0x7
REFUSED_KEPT = 4096   # refused streams whose late data is dropped, per connection


class QuicDriver:
    """Subclasses handle events in `quic_event(event)`; `send(data, addr)` writes a datagram."""

    def __init__(self, quic, send: Callable[[bytes, object], None]):
        self.quic = quic
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._soon: asyncio.Handle | None = None   # a transmit queued for later in this turn, or ANSWER_WAIT

    def quic_event(self, event) -> None:
        raise NotImplementedError

    def answer_pending(self) -> bool:
        return False

    def receive(self, data: bytes, addr) -> None:
        self.quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        if self._soon is None and self.answer_pending():
            self._soon = self._loop.call_later(ANSWER_WAIT, self.transmit)
        else:
            self.transmit_soon()

    def transmit_soon(self) -> None:
        """A transmit at the end of this loop turn (not later: an ANSWER_WAIT one is advanced)."""
        if self._soon is None or isinstance(self._soon, asyncio.TimerHandle):
            if self._soon is not None:
                self._soon.cancel()
            self._soon = self._loop.call_soon(self.transmit)

    def transmit(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        for data, addr in self.quic.datagrams_to_send(now=self._loop.time()):
            self._send(data, addr)
        at = self.quic.get_timer()
        if at is not None and (self._timer_at is None or at < self._timer_at):
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        now = self._loop.time()
        at = self.quic.get_timer()
        if at is None:
            return
        if at > now:   # the deadline moved later since it was armed
            self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at
            return
        self.quic.handle_timer(now=now)
        self._process_events()
        self.transmit()

    def _process_events(self) -> None:
        while (event := self.quic.next_event()) is not None:
            self.quic_event(event)

    def stop_timer(self) -> None:
        """The connection is over: no timer, no queued transmit."""
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._timer_at = self._soon = None


class H3Error(Exception):
    """A connection error (RFC 9114 8): close the connection with `code`."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


# what `H3Streams.receive` reports
Headers = namedtuple("Headers", "stream_id headers ended")   # headers: [(name, value)] as bytes
Data = namedtuple("Data", "stream_id data ended")
TooLarge = namedtuple("TooLarge", "stream_id size")   # HEADERS of `size` bytes over the limit: the rest is dropped
GoAway = namedtuple("GoAway", "last_id")


def varint(data: bytes, at: int) -> tuple[int, int]:
    """The variable-length integer at `at` (RFC 9000 16) and the offset after it; IndexError
    when `data` ends first."""
    first = data[at]
    size = 1 << (first >> 6)
    if at + size > len(data):
        raise IndexError
    return int.from_bytes(data[at:at + size], "big") & ((1 << (8 * size - 2)) - 1), at + size


def frame(frame_type: int, payload: bytes) -> bytes:
    return encode_uint_var(frame_type) + encode_uint_var(len(payload)) + payload


class _Stream:
    __slots__ = ("buffer", "data_left", "headers_seen")

    def __init__(self) -> None:
        self.buffer = b""
        self.data_left = 0        # bytes of the DATA frame being read still to come
        self.headers_seen = False


class H3Streams:
    """The HTTP/3 layer of one connection: `send` writes messages, `receive` turns a QUIC
    connection's stream data into Headers / Data / TooLarge / GoAway events."""

    def __init__(self, quic: QuicConnection, *, is_client: bool, max_field_section_size: int):
        self.quic = quic
        self.is_client = is_client
        self.max_field_section_size = max_field_section_size
        self._encoder = pylsqpack.Encoder()
        self._encoder.apply_settings(max_table_capacity=0, blocked_streams=0)
        self._decoder = pylsqpack.Decoder(0, 0)
        self._streams: dict[int, _Stream] = {}
        self._uni_types: dict[int, int | None] = {}   # the peer's unidirectional streams
        self._refused = BoundedMemo(REFUSED_KEPT)
        self._control = b""   # an incomplete frame of the peer's control stream
        settings = b"".join(encode_uint_var(k) + encode_uint_var(v) for k, v in (
            (QPACK_MAX_TABLE_CAPACITY, 0), (QPACK_BLOCKED_STREAMS, 0),
            (MAX_FIELD_SECTION_SIZE, max_field_section_size)))
        control = quic.get_next_available_stream_id(is_unidirectional=True)
        quic.send_stream_data(control, encode_uint_var(CONTROL_STREAM) + frame(SETTINGS, settings))

    # ---- sending -------------------------------------------------------------------------
    def send(self, stream_id: int, headers: list[tuple[bytes, bytes]], body: bytes = b"",
             end_stream: bool = True) -> None:
        """A message: its HEADERS frame and, with a body, one DATA frame, in one write."""
        _, block = self._encoder.encode(stream_id, headers)
        data = frame(HEADERS, block)
        if body:
            data += frame(DATA, body)
        self.quic.send_stream_data(stream_id, data, end_stream)

    # ---- receiving -----------------------------------------------------------------------
    def receive(self, stream_id: int, data: bytes, ended: bool) -> list:
        """Events for what arrived on `stream_id`; raises H3Error (a connection error)."""
        if stream_id & 2:
            return self._receive_uni(stream_id, data)
        if stream_id in self._refused:
            if ended:
                self._refused.pop(stream_id, None)
            return []
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = _Stream()
        events: list = []
        buffer = stream.buffer + data if stream.buffer else data
        at = 0
        while at < len(buffer):
            if stream.data_left:
                chunk = buffer[at:at + stream.data_left]
                stream.data_left -= len(chunk)
                at += len(chunk)
                events.append(Data(stream_id, chunk, ended and at == len(buffer) and not stream.data_left))
                continue
            try:
                frame_type, start = varint(buffer, at)
                length, start = varint(buffer, start)
            except IndexError:
                break
            if frame_type == DATA:
                if not stream.headers_seen:
                    raise H3Error(ErrorCode.H3_FRAME_UNEXPECTED, "DATA before HEADERS")
                stream.data_left, at = length, start
                if not length:
                    events.append(Data(stream_id, b"", ended and at == len(buffer)))
                continue
            if frame_type == HEADERS and not stream.headers_seen and length > self.max_field_section_size:
                del self._streams[stream_id]
                if not ended:
                    self._refused.add(stream_id)
                return [*events, TooLarge(stream_id, length)]
            if start + length > len(buffer):
                break   # the frame is not whole yet
            payload, at = buffer[start:start + length], start + length
            if frame_type == HEADERS:
                try:
                    _, headers = self._decoder.feed_header(stream_id, payload)
                except (pylsqpack.DecompressionFailed, pylsqpack.StreamBlocked) as exc:
                    raise H3Error(ErrorCode.QPACK_DECOMPRESSION_FAILED, str(exc)) from None
                if not stream.headers_seen:   # trailers are read and dropped
                    stream.headers_seen = True
                    events.append(Headers(stream_id, headers, ended and at == len(buffer)))
                elif ended and at == len(buffer):
                    events.append(Data(stream_id, b"", True))
            elif frame_type in _CONTROL_FRAMES:
                raise H3Error(ErrorCode.H3_FRAME_UNEXPECTED, f"frame type {frame_type:#x} on a request stream")
            # other types are reserved or unknown: ignored (RFC 9114 9)
        stream.buffer = buffer[at:]
        if ended:
            del self._streams[stream_id]
            if stream.buffer or stream.data_left:
                raise H3Error(ErrorCode.H3_FRAME_ERROR, "stream ended within a frame")
            if not events and stream.headers_seen:
                events.append(Data(stream_id, b"", True))
        return events

    def forget(self, stream_id: int) -> None:
        """The stream was reset or refused: drop what is buffered and whatever still comes."""
        if self._streams.pop(stream_id, None) is not None or not self.is_client:
            self._refused.add(stream_id)

    def _receive_uni(self, stream_id: int, data: bytes) -> list:
        kind = self._uni_types.get(stream_id)
        buffer = data
        if kind is None:
            try:
                kind, at = varint(data, 0)
            except IndexError:
                return []   # the type is one octet for every stream we read
            self._uni_types[stream_id] = kind
            buffer = data[at:]
        if kind != CONTROL_STREAM:
            return []   # QPACK streams (no table: nothing to read), pushes, unknown types
        buffer = self._control + buffer
        events: list = []
        at = 0
        while True:
            try:
                frame_type, start = varint(buffer, at)
                length, start = varint(buffer, start)
            except IndexError:
                break
            if start + length > len(buffer):
                break
            payload, at = buffer[start:start + length], start + length
            if frame_type == GOAWAY:
                events.append(GoAway(varint(payload, 0)[0]))
        self._control = buffer[at:]
        return events
