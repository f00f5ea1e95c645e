"""quic_lean.LeanH3.send_message writes what aioquic's send_headers + send_data write."""

from __future__ import annotations

import pytest
from aioquic.h3.connection import FrameUnexpected, Setting
from aioquic.quic.configuration import QuicConfiguration

from sdcp_fast.transport.quic_lean import LeanH3


class RecordingQuic:
    """The QuicConnection calls H3Connection makes when it sends, recorded per stream."""

    def __init__(self, is_client: bool):
        self.configuration = QuicConfiguration(is_client=is_client)
        self._quic_logger = None
        self._next = {False: 0 if is_client else 1, True: 2 if is_client else 3}
        self.sent: dict[int, bytearray] = {}
        self.ended: set[int] = set()

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        stream_id = self._next[is_unidirectional]
        self._next[is_unidirectional] += 4
        return stream_id

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        assert stream_id not in self.ended, "data after the end of the stream"
        self.sent.setdefault(stream_id, bytearray()).extend(data)
        if end_stream:
            self.ended.add(stream_id)


REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v.example:4433"),
           (b":path", b"/proposals"), (b"content-type", b"application/sdcp+cbor"),
           (b"content-length", b"5")]
ANSWER = [(b":status", b"200"), (b"content-type", b"application/sdcp+cbor"), (b"content-length", b"5")]


@pytest.mark.parametrize("is_client, headers", [(True, REQUEST), (False, ANSWER)])
def test_send_message_writes_the_frames_send_headers_and_send_data_write(is_client, headers):
    lean_quic, plain_quic = RecordingQuic(is_client), RecordingQuic(is_client)
    lean, plain = LeanH3(lean_quic), LeanH3(plain_quic)
    lean._received_settings = lean._get_local_settings()   # our peer's: no QPACK table
    for stream_id in (0, 4, 8):   # more streams: the QPACK state carries over alike, blocks remembered
        lean.send_message(stream_id, headers, b"hello")
        plain.send_headers(stream_id, headers)
        plain.send_data(stream_id, b"hello", end_stream=True)
    assert lean_quic.sent == plain_quic.sent
    assert lean_quic.ended == plain_quic.ended == {0, 4, 8}
    assert len(lean._header_frames) == 1
    assert lean._stream.keys() == plain._stream.keys()


def test_a_header_block_referring_to_the_dynamic_table_is_not_remembered():
    """A peer (not ours) whose SETTINGS allow a QPACK table: blocks that use it are coded
    each time, as aioquic codes them."""
    lean_quic, plain_quic = RecordingQuic(False), RecordingQuic(False)
    lean, plain = LeanH3(lean_quic), LeanH3(plain_quic)
    for h3 in (lean, plain):   # as the peer's SETTINGS would
        h3._received_settings = {Setting.QPACK_MAX_TABLE_CAPACITY: 4096, Setting.QPACK_BLOCKED_STREAMS: 16}
        h3._encoder.apply_settings(4096, 16)
    headers = [(b":status", b"200"), (b"x-custom-field", b"a value worth indexing")]
    for stream_id in (1, 5, 9):
        lean.send_message(stream_id, headers, b"hello")
        plain.send_headers(stream_id, headers)
        plain.send_data(stream_id, b"hello", end_stream=True)
    assert lean_quic.sent == plain_quic.sent
    assert lean._encoder_bytes_sent and not lean._header_frames


def test_send_message_after_headers_is_aioquics_send_headers_and_send_data():
    lean = LeanH3(RecordingQuic(True))
    lean.send_headers(4, REQUEST)
    with pytest.raises(FrameUnexpected):   # a second header block is trailers: no DATA after them
        lean.send_message(4, REQUEST, b"hello")


class TimerQuic:
    """A QuicConnection reduced to its timer: `deadline` is what get_timer() answers."""

    def __init__(self):
        import collections

        self.deadline: float | None = None
        self.handled: list[float] = []
        self._events: collections.deque = collections.deque()

    def datagrams_to_send(self, now: float):
        return []

    def get_timer(self) -> float | None:
        return self.deadline

    def handle_timer(self, now: float) -> None:
        self.handled.append(now)
        self.deadline = None

    def next_event(self):
        return None


class FakeLoop:
    """Timers recorded, not run: `armed` lists (when, handle) as call_at made them."""

    def __init__(self):
        self.now = 100.0
        self.armed: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback):
        import asyncio
        handle = asyncio.TimerHandle(when, callback, (), self)
        self.armed.append((when, handle))
        return handle

    def _timer_handle_cancelled(self, handle) -> None:
        pass

    def get_debug(self) -> bool:
        return False


def test_the_loop_timer_is_rearmed_only_to_fire_earlier_and_never_acts_before_its_deadline():
    import asyncio

    from sdcp_fast.transport.quic_lean import LeanAcks

    async def made() -> LeanAcks:   # aioquic's protocol takes the running loop
        return LeanAcks(quic)

    quic, loop = TimerQuic(), FakeLoop()
    protocol = asyncio.run(made())
    protocol._loop = loop
    protocol._transport = type("Transport", (), {"sendto": lambda *args: None})()
    quic.deadline = 100.030
    protocol.transmit()
    assert [when for when, _ in loop.armed] == [100.030]
    quic.deadline = 100.050   # later (loss detection after another packet): the armed timer stays
    protocol.transmit()
    assert len(loop.armed) == 1 and not loop.armed[0][1].cancelled()
    quic.deadline = 100.010   # earlier (an ACK owed): re-armed for it
    protocol.transmit()
    assert loop.armed[0][1].cancelled() and loop.armed[-1][0] == 100.010
    quic.deadline = 100.040
    protocol.transmit()
    loop.now = 100.010
    protocol._handle_timer()   # fires for 100.010, the deadline is now 100.040: re-armed, nothing handled
    assert quic.handled == [] and loop.armed[-1][0] == 100.040
    loop.now = 100.040
    protocol._handle_timer()
    assert quic.handled == [100.040] and protocol._timer is None   # handled; nothing asked after it
    quic.deadline = 100.060
    protocol.transmit()
    quic.deadline = None      # nothing to wait for: the armed timer goes
    protocol.transmit()
    assert loop.armed[-1][1].cancelled() and protocol._timer is None


def _message(headers, body: bytes, *, is_client_sending: bool, long_lengths: bool = False) -> bytes:
    """HEADERS + DATA as a peer sends them (QPACK without the dynamic table)."""
    import pylsqpack
    from aioquic.buffer import encode_uint_var

    encoder = pylsqpack.Encoder()
    _, block = encoder.encode(0, headers)

    def frame(kind: int, payload: bytes) -> bytes:
        if long_lengths:   # a non-minimal 4-byte length: allowed (RFC 9000 16)
            return bytes([kind]) + (0x80000000 | len(payload)).to_bytes(4, "big") + payload
        return encode_uint_var(kind) + encode_uint_var(len(payload)) + payload

    return frame(1, block) + frame(0, body)


def _outcome(h3, data: bytes, generic: bool):
    from aioquic.h3.connection import H3Connection, H3Stream

    stream = H3Stream(0)
    try:
        if generic:
            events = H3Connection._receive_request_or_push_data(h3, stream, data, True)
        else:
            events = h3._receive_request_or_push_data(stream, data, True)
        result = ("events", events)
    except Exception as exc:   # the same refusal, with the same reason
        result = ("raised", type(exc).__name__, str(exc))
    return result, {name: value for name, value in vars(stream).items() if name != "interim_response_received"} \
        | {"interim": getattr(stream, "interim_response_received", False)}


BODY = b"\xa1\x01\x02"
WHOLE_MESSAGES = [
    (False, _message(REQUEST[:5], BODY, is_client_sending=True)),
    (False, _message(REQUEST, b"12345", is_client_sending=True)),                      # content-length agrees
    (False, _message(REQUEST, b"1234", is_client_sending=True)),                       # ... or not
    (False, _message(REQUEST[:5], BODY * 100, is_client_sending=True, long_lengths=True)),
    (False, _message([(b":method", b"POST"), (b":path", b"/x")], BODY, is_client_sending=True)),   # no :authority
    (False, _message(REQUEST[:5] + [(b"Upper", b"x")], BODY, is_client_sending=True)),
    (False, _message(REQUEST[:5], b"", is_client_sending=True)),
    (False, _message(REQUEST[:5], BODY, is_client_sending=True) + b"\x00\x01x"),          # another frame: aioquic's loop
    (False, _message(REQUEST[:5], BODY, is_client_sending=True)[:-1]),                   # truncated
    (False, b"\x01\x03\x00\x00\xff\x00\x01x"),                                               # a broken header block
    (True, _message(ANSWER[:2], BODY, is_client_sending=False)),
    (True, _message(ANSWER, b"12345", is_client_sending=False)),
    (True, _message(ANSWER, b"123456", is_client_sending=False)),
    (True, _message([(b":status", b"103")], BODY, is_client_sending=False)),               # interim, then DATA
    (True, _message([(b":status", b"20x")], BODY, is_client_sending=False)),
    (True, _message([(b"content-type", b"x")], BODY, is_client_sending=False)),            # no :status
]


@pytest.mark.parametrize("is_client, data", WHOLE_MESSAGES)
def test_a_whole_message_is_read_as_aioquics_frame_loop_reads_it(is_client, data):
    fast, generic = LeanH3(RecordingQuic(is_client)), LeanH3(RecordingQuic(is_client))
    assert _outcome(fast, data, generic=False) == _outcome(generic, data, generic=True)


@pytest.mark.parametrize("is_client, data", WHOLE_MESSAGES)
def test_a_header_block_read_again_is_read_as_the_first_time(is_client, data):
    """Read a second time (remembered on the connection when it passed): the same outcome, the
    same stream state, and a list of its own."""
    fast, generic = LeanH3(RecordingQuic(is_client)), LeanH3(RecordingQuic(is_client))
    first, again = _outcome(fast, data, generic=False), _outcome(fast, data, generic=False)
    assert first == again == _outcome(generic, data, generic=True)
    if first[0][0] == "events" and first[0][1]:
        assert len(fast._header_blocks) <= 1   # (another shape than a whole message: aioquic reads it)
        events = _outcome(fast, data, generic=False)[0][1]
        assert events[0].headers is not first[0][1][0].headers


def test_remembered_header_blocks_are_bounded():
    fast = LeanH3(RecordingQuic(False))
    for n in range(LeanH3.REMEMBERED_HEADER_BLOCKS + 3):
        headers = [*REQUEST[:4], (b"x-n", str(n).encode())]
        assert _outcome(fast, _message(headers, BODY, is_client_sending=True), generic=False)[0][0] == "events"
        assert len(fast._header_blocks) <= LeanH3.REMEMBERED_HEADER_BLOCKS
    big = [*REQUEST[:4], (b"x-big", b"y" * 2 * LeanH3.REMEMBERED_HEADER_BLOCK_SIZE)]
    fast._header_blocks.clear()
    assert _outcome(fast, _message(big, BODY, is_client_sending=True), generic=False)[0][0] == "events"
    assert not fast._header_blocks


def test_events_reach_the_protocol_in_order_and_aioquic_still_handles_its_own():
    import asyncio

    from aioquic.quic.events import HandshakeCompleted, PingAcknowledged, StreamDataReceived

    from sdcp_fast.transport.quic_lean import LeanAcks

    quic = TimerQuic()

    class Recording(LeanAcks):
        def __init__(self, quic):
            super().__init__(quic)
            self.seen: list = []

        def quic_event_received(self, event) -> None:
            self.seen.append(event)

    async def main():
        protocol = Recording(quic)
        protocol._connected_waiter = asyncio.get_running_loop().create_future()
        ping = asyncio.get_running_loop().create_future()
        protocol._ping_waiters[7] = ping
        events = [StreamDataReceived(b"a", False, 0), HandshakeCompleted("h3", False, False),
                  StreamDataReceived(b"b", True, 0), PingAcknowledged(7), StreamDataReceived(b"c", False, 4)]
        quic._events.extend(events)
        quic.next_event = lambda: quic._events.popleft() if quic._events else None
        protocol._process_events()
        assert protocol.seen == events and not quic._events
        assert protocol._connected and ping.done()   # aioquic's own handling ran

    asyncio.run(main())


def test_a_request_stream_is_kept_and_forgotten_as_aioquic_keeps_it():
    from aioquic.h3.connection import H3Connection
    from aioquic.quic.events import StreamDataReceived

    data = _message(REQUEST[:5], BODY, is_client_sending=True)
    lean, plain = LeanH3(RecordingQuic(False)), LeanH3(RecordingQuic(False))
    for stream_id, chunks in ((0, [data]), (4, [data[:7], data[7:]])):   # whole; in two pieces
        for at, chunk in enumerate(chunks):
            event = StreamDataReceived(chunk, at == len(chunks) - 1, stream_id)
            assert lean._receive_stream_data(event) == H3Connection._receive_stream_data(plain, event)
            assert lean._stream.keys() == plain._stream.keys() == {0, 4} & set(range(stream_id + 1))
    for stream_id in (0, 4):
        lean.send_message(stream_id, ANSWER, b"hello")
        plain.send_headers(stream_id, ANSWER)
        plain.send_data(stream_id, b"hello", end_stream=True)
        assert lean._stream.keys() == plain._stream.keys()
    assert not lean._stream   # both ways ended: forgotten
