"""Received frames read without h2's frame buffer (LeanConnection.receive_data): for every
byte stream, cut anywhere, the connection's events, the bytes it queues, the error it
raises and its books (stream states, flow-control windows) are those of h2's own
receive_data. Sans-IO: byte streams made by an h2 client, and frames made by hand for the
cases h2 would not send."""

from __future__ import annotations

import itertools
import random
import re
import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest

from sdcp_fast.transport.client_h2 import ClientConnection
from sdcp_fast.transport.h2_lean import lean_config
from sdcp_fast.transport.server_h2 import ServerConnection

REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v"), (b":path", b"/v1/x"),
           (b"content-type", b"application/sdcp+cbor")]
BODY = bytes(range(256)) * 3


class H2Server(ServerConnection):
    """The server connection with h2's own receive_data: what the lean one must equal."""

    receive_data = h2.connection.H2Connection.receive_data


class H2Client(ClientConnection):
    receive_data = h2.connection.H2Connection.receive_data


def _server(cls):
    server = cls(lean_config(client_side=False, validate_inbound_headers=False, normalize_inbound_headers=False))
    server.initiate_connection()
    server.data_to_send()
    return server


def _client() -> h2.connection.H2Connection:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    return client


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    size = len(payload)
    return struct.pack(">BHBBL", size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def _requests() -> bytes:
    """What an h2 client sends for a mix of requests: whole messages (the lean path), padded
    DATA, a HEADERS frame with a priority, a header block continued in CONTINUATION frames,
    a body in several DATA frames, PING, WINDOW_UPDATE, a reset stream."""
    client = _client()
    out = [client.data_to_send()]
    for body in (BODY, b"", b"x" * 5000):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST, end_stream=not body)
        if body:
            client.send_data(stream_id, body, end_stream=True)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.send_data(stream_id, b"padded", pad_length=7, end_stream=True)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST, priority_weight=200, end_stream=True)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [*REQUEST, (b"x-long", b"v" * 20000)], end_stream=True)   # CONTINUATION
    client.ping(b"12345678")
    client.increment_flow_control_window(1000)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.send_data(stream_id, b"part")
    client.reset_stream(stream_id)
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.send_data(stream_id, b"a" * 100)
    client.send_data(stream_id, b"b" * 100, end_stream=True)
    out.append(client.data_to_send())
    return b"".join(out)


def _after_reset() -> bytes:
    """DATA on a stream the client reset (h2 answers RST_STREAM, no error)."""
    client = _client()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.reset_stream(stream_id)
    return client.data_to_send() + _frame(0x0, 0x1, stream_id, b"late")


def _with_preface(*frames: bytes) -> bytes:
    return _client().data_to_send() + b"".join(frames)


def _block(headers=REQUEST) -> bytes:
    """A header block coded by a fresh encoder (literals: it decodes whatever the table holds)."""
    return h2.connection.H2Connection().encoder.encode(headers)


HEADERS_BLOCK = _block()


def _message(stream_id: int, body: bytes, block: bytes = HEADERS_BLOCK) -> bytes:
    """A request as one HEADERS frame that does not end the stream and one DATA frame that does."""
    return _frame(0x1, 0x4, stream_id, block) + _frame(0x0, 0x1, stream_id, body)


def _after_one(*frames: bytes) -> bytes:
    """`frames` after a first whole message on stream 1: a server counts its streams (h2's
    walk) at its first request, and takes the next ones whole (`_receive_message`)."""
    return _with_preface(_message(1, b"first"), *frames)


def _many(count: int, body: bytes = b"x" * 100) -> bytes:
    return _with_preface(*(_message(2 * n + 1, body) for n in range(count)))

STREAMS = {
    "requests": _requests(),
    "data after a reset": _after_reset(),
    "data on stream 0": _with_preface(_frame(0x0, 0x1, 0, b"x")),
    "headers on stream 0": _with_preface(_frame(0x1, 0x5, 0, HEADERS_BLOCK)),
    "headers on an even stream": _with_preface(_frame(0x1, 0x5, 2, HEADERS_BLOCK)),
    "data on an idle stream": _with_preface(_frame(0x0, 0x1, 3, b"x")),
    "the reserved bit set": _with_preface(_frame(0x1, 0x5, 0x80000001, HEADERS_BLOCK)),
    "a frame over the size limit": _with_preface(_frame(0x0, 0x0, 1, b"x" * 16385)),
    "a header block that does not decode": _with_preface(_frame(0x1, 0x5, 1, b"\xff\xff\xff\xff")),
    "headers after end of stream": _with_preface(_frame(0x1, 0x5, 1, HEADERS_BLOCK),
                                                 _frame(0x1, 0x5, 1, HEADERS_BLOCK)),
    "a cut header block then data": _with_preface(_frame(0x1, 0x0, 1, HEADERS_BLOCK),
                                                  _frame(0x0, 0x1, 1, b"x")),
    "unknown flags on data": _with_preface(_frame(0x1, 0x4, 1, HEADERS_BLOCK), _frame(0x0, 0x41, 1, b"x")),
    # whole messages (HEADERS then DATA ending the stream), and each case they must leave to h2
    "whole messages past prune walks": _many(30),
    "more whole messages than the stream limit": _many(110),
    "whole messages past the connection window": _many(6, b"y" * 16000),
    "a body longer than its content-length": _after_one(
        _message(3, b"12345", _block([*REQUEST, (b"content-length", b"3")])), _message(5, b"ok")),
    "a body shorter than its content-length": _after_one(
        _message(3, b"12", _block([*REQUEST, (b"content-length", b"3")]))),
    "a body as long as its content-length": _after_one(
        _message(3, b"123", _block([*REQUEST, (b"content-length", b"3")]))),
    "a content-length that is not a number": _after_one(
        _message(3, b"12", _block([*REQUEST, (b"content-length", b"x")])), _message(5, b"ok")),
    "a request that looks informational": _after_one(
        _message(3, b"12", _block([(b":status", b"100"), *REQUEST])), _message(5, b"ok")),
    "a whole message that reuses a stream id": _after_one(_message(3, b"a"), _message(3, b"b")),
    "a whole message on a lower stream id": _after_one(_message(7, b"a"), _message(5, b"b")),
    "a whole message on an even stream id": _after_one(_message(4, b"a")),
    "a whole message whose block does not decode": _after_one(_message(3, b"a", b"\xff\xff\xff\xff")),
    "a whole message after the client's GOAWAY": _after_one(_frame(0x7, 0x0, 0, bytes(8)), _message(3, b"b")),
    "data of another stream after headers": _with_preface(_frame(0x1, 0x4, 1, HEADERS_BLOCK),
                                                          _frame(0x0, 0x1, 3, b"x")),
}


def _cuts(size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.sample(range(1, size), min(size - 1, rng.randint(1, 12))))


def _ways(data: bytes) -> list[list[bytes]]:
    """The byte stream whole, a byte at a time (short ones), and cut at random places."""
    ways = [[data]]
    if len(data) < 400:
        ways.append([data[i:i + 1] for i in range(len(data))])
    for seed in range(8):
        points = [0, *_cuts(len(data), seed), len(data)]
        ways.append([data[a:b] for a, b in itertools.pairwise(points)])
    return ways


def _books(conn) -> tuple:
    streams = {sid: (s.state_machine.state, s.inbound_flow_control_window, s.outbound_flow_control_window)
               for sid, s in conn.streams.items()}
    return (conn.state_machine.state, conn.inbound_flow_control_window, conn.outbound_flow_control_window,
            conn.highest_inbound_stream_id, streams)


def _shown(event) -> object:
    """An event as compared: h2's repr, or the fields of one of ours (StreamError)."""
    return repr(event) if type(event).__repr__ is not object.__repr__ else (type(event).__name__, vars(event))


def _feed(conn, pieces: list[bytes]) -> tuple:
    """What the connection makes of the pieces: (events, error, bytes queued, its books)."""
    events, error = [], None
    for piece in pieces:
        try:
            events.append([_shown(e) for e in conn.receive_data(piece)])
        except h2.exceptions.ProtocolError as exc:
            error = (type(exc).__name__, re.sub(r"0x[0-9a-f]+", "0x", str(exc)))   # no addresses
            break
    return events, error, conn.data_to_send(), _books(conn)


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_server_receives_as_h2s_receive_data(name):
    for pieces in _ways(STREAMS[name]):
        assert _feed(_server(ServerConnection), pieces) == _feed(_server(H2Server), pieces)


def test_the_lean_paths_take_whole_messages():
    """A server takes a whole request in one go (`_receive_message`), except where h2's
    stream count is due (the first, then one in PRUNE_EVERY), which goes frame by frame
    without h2's buffer: the bulk of what arrives (the point of it)."""
    frames, messages = [], []

    class Counting(ServerConnection):
        def _receive_frame(self, frame):
            frames.append(type(frame).__name__)
            return super()._receive_frame(frame)

        def _receive_message(self, stream_id, block, body):
            taken = super()._receive_message(stream_id, block, body)
            messages.append(taken is not None)
            return taken

    server = _server(Counting)
    client = _client()
    server.receive_data(client.data_to_send())
    seen = len(frames)
    for _ in range(4):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST)
        client.send_data(stream_id, BODY, end_stream=True)
    before = server.incoming_buffer._data
    events = server.receive_data(client.data_to_send())
    assert [type(e).__name__ for e in events].count("StreamEnded") == 4
    assert messages == [False, True, True, True]
    assert frames[seen:] == ["ReceivedHeadersFrame", "ReceivedDataFrame"]
    assert not before and not server.incoming_buffer._data


def _responses() -> bytes:
    """What an h2 server sends a client: answers (the lean path), SETTINGS, WINDOW_UPDATE,
    PING, a padded answer, GOAWAY."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    client = _client()
    for _ in range(4):
        client.send_headers(client.get_next_available_stream_id(), REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    server.send_data(1, BODY, end_stream=True)
    server.send_headers(3, [(b":status", b"204")], end_stream=True)
    server.increment_flow_control_window(5000)
    server.ping(b"abcdefgh")
    server.send_headers(5, [(b":status", b"200")])
    server.send_data(5, b"padded", pad_length=3, end_stream=True)
    server.close_connection(last_stream_id=5)
    return server.data_to_send()


def _lean_client(cls):
    client = cls(lean_config(client_side=True))
    client.initiate_connection()
    for _ in range(4):
        client.send_headers(client.get_next_available_stream_id(), REQUEST, end_stream=True)
    client.data_to_send()
    return client


def test_the_client_receives_as_h2s_receive_data():
    data = _responses()
    for pieces in _ways(data):
        assert _feed(_lean_client(ClientConnection), pieces) == _feed(_lean_client(H2Client), pieces)


@pytest.mark.parametrize("sizes", [[100] * 400, [16000] * 8, [16384, 16384, 16384, 16383], [0, 1, 40000]])
def test_request_data_is_acknowledged_as_by_h2(sizes):
    """ServerConnection.acknowledge_request_data: the windows, and the WINDOW_UPDATE frames
    queued, as h2's acknowledge_received_data gives them; for streams open and ended, and for
    one h2 no longer holds (its error)."""
    def run(acknowledge) -> list:
        server, client, seen = _server(ServerConnection), _client(), []
        server.receive_data(client.data_to_send())
        server.data_to_send()
        for size in sizes:
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, REQUEST)
            for part in range(0, max(size, 1), 16384):
                piece = b"x" * min(16384, size - part)
                client.send_data(stream_id, piece, end_stream=part + 16384 >= size)
            events = server.receive_data(client.data_to_send())
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    acknowledge(server, event.stream_id, event.flow_controlled_length)
            out = server.data_to_send()
            seen.append((out, _books(server)))
            client.receive_data(out)   # the credit given back
        for stream_id in (1, 10001):   # ended long ago and pruned, never opened
            try:
                acknowledge(server, stream_id, 10)
                seen.append((server.data_to_send(), _books(server)))
            except Exception as exc:   # noqa: BLE001 (h2's error, whatever it is)
                seen.append((type(exc).__name__, str(exc)))
        return seen

    lean = run(lambda server, stream_id, size: server.acknowledge_request_data(stream_id, size))
    assert lean == run(lambda server, stream_id, size: server.acknowledge_received_data(size, stream_id))
