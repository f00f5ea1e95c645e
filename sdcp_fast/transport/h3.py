"""HTTP/3 framing (RFC 9114) on a QUIC connection, for both ends: aioquic's QuicConnection and
pylsqpack's QPACK through their public APIs.

Why not aioquic's H3Connection: its public API cannot keep what RFC 9114 makes a stream error
(a malformed request, 4.1.2) on its stream (it closes the connection), cannot refuse a HEADERS
frame over the advertised field-section size before buffering it, and always offers a QPACK
dynamic table, whose decoder-stream acknowledgements cost a packet of their own per request.
The framing is small (a type and a length per frame, RFC 9114 7.1), so it is done here:
  - both ends advertise a QPACK table capacity of 0 and no blocked streams (RFC 9204 3.2.3):
    header blocks use the static table and literals, no encoder or decoder stream is opened
    (RFC 9204 4.2 allows that), and a block decodes the same whatever came before;
  - a message is one HEADERS frame and at most one DATA frame written in one stream write;
  - on a request stream, HEADERS longer than `max_field_section_size` is reported as
    `TooLarge` as soon as its length is read, and the rest of the stream is dropped unread;
  - a frame that breaks the framing itself (DATA before HEADERS, a control frame on a
    request stream, a header block QPACK cannot decode) is a connection error: `H3Error`.
"""

from __future__ import annotations

import pylsqpack
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameUnexpected
from aioquic.quic.connection import QuicConnection

from .exchange import BoundedMemo

DATA, HEADERS, SETTINGS, GOAWAY = 0x0, 0x1, 0x4, 0x7
_CONTROL_FRAMES = frozenset({0x3, SETTINGS, 0x5, GOAWAY, 0xD})   # never on a request stream
CONTROL_STREAM = 0x0
QPACK_MAX_TABLE_CAPACITY, MAX_FIELD_SECTION_SIZE, QPACK_BLOCKED_STREAMS = 0x1, 0x6, 0x7
REFUSED_KEPT = 4096   # refused streams whose late data is dropped, per connection


class H3Error(Exception):
    """A connection error (RFC 9114 8): close the connection with `code`."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Headers:
    __slots__ = ("stream_id", "headers", "ended")

    def __init__(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool):
        self.stream_id, self.headers, self.ended = stream_id, headers, ended


class Data:
    __slots__ = ("stream_id", "data", "ended")

    def __init__(self, stream_id: int, data: bytes, ended: bool):
        self.stream_id, self.data, self.ended = stream_id, data, ended


class TooLarge:
    """A HEADERS frame of `size` bytes over the limit: the stream's data is dropped from here."""

    __slots__ = ("stream_id", "size")

    def __init__(self, stream_id: int, size: int):
        self.stream_id, self.size = stream_id, size


class GoAway:
    __slots__ = ("last_id",)

    def __init__(self, last_id: int):
        self.last_id = last_id


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

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        """More of a body; FrameUnexpected once the stream can no longer send (the peer
        stopped it with STOP_SENDING, or it was reset)."""
        try:
            self.quic.send_stream_data(stream_id, frame(DATA, data) if data else b"", end_stream)
        except (ValueError, RuntimeError) as exc:
            raise FrameUnexpected(f"DATA on stream {stream_id}: {exc}") from exc

    # ---- receiving -----------------------------------------------------------------------
    def receive(self, stream_id: int, data: bytes, ended: bool) -> list:
        """Events for what arrived on `stream_id`; raises H3Error (a connection error)."""
        if stream_id & 2:
            return self._receive_uni(stream_id, data)
        if stream_id in self._refused:
            if ended:
                self._refused.forget(stream_id)
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
            if kind == CONTROL_STREAM:
                self._control = b""
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

    _control = b""
