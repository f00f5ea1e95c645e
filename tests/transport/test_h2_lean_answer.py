"""The HTTP/2 server's answer in one go (ServerConnection.send_whole_answer): a client sees
what h2's own send_headers + send_data would have sent, the server's state moves the same
way, and every case it does not take is left to h2 with nothing changed. Sans-IO: a server
connection and an h2 client connection exchange bytes directly."""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from transport_h2pair import exchange, received

from sdcp_fast.transport.exchange import response_headers
from sdcp_fast.transport.h2_lean import lean_config
from sdcp_fast.transport.http import Response
from sdcp_fast.transport.server_h2 import (
    ServerConnection,
    answer_block,
)

BODY = bytes(range(200)) * 3


def _pair() -> tuple[h2.connection.H2Connection, ServerConnection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = ServerConnection(lean_config(
        client_side=False, validate_inbound_headers=False, normalize_inbound_headers=False))
    client.initiate_connection()
    server.initiate_connection()
    _exchange(client, server)
    return client, server


def _exchange(client, server) -> list[h2.events.Event]:
    """Move bytes both ways until quiet; the client's events."""
    return exchange(client, server)[0]


def _request(client, server) -> int:
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v"),
                                    (b":path", b"/v1/x")], end_stream=True)
    _exchange(client, server)
    return stream_id


def _answer(server, stream_id: int, response: Response, way: str) -> None:
    """Answer the request on `stream_id` whole (send_whole_answer) or through h2's own
    send_headers and send_data."""
    if way == "whole":
        assert server.send_whole_answer(stream_id, answer_block(response), response.body)
    else:
        server.send_headers(stream_id, response_headers(response), end_stream=not response.body)
        if response.body:
            server.send_data(stream_id, response.body, end_stream=True)


@pytest.mark.parametrize("response", [Response(200, BODY), Response(204, content_type=None),
                                      Response(404, b'{"type":"x"}', content_type="application/problem+cbor")])
def test_the_client_sees_what_h2s_own_path_sends(response: Response):
    seen = {}
    for way in ("whole", "h2"):
        client, server = _pair()
        answers = []
        for _ in range(3):   # later answers too: h2 indexes content-type in the table after the first
            stream_id = _request(client, server)
            _answer(server, stream_id, response, way)
            answers += received(_exchange(client, server))
            if way == "whole":   # ended, and out of h2's streams at once
                assert stream_id not in server.streams
            else:
                stream = server.streams[stream_id]
                assert stream.closed and stream.closed_by == h2.stream.StreamClosedBy.SEND_END_STREAM
                assert server.open_inbound_streams == 0   # h2's count takes it out
            assert server._closed_streams[stream_id] == h2.stream.StreamClosedBy.SEND_END_STREAM
        seen[way] = (answers, server.outbound_flow_control_window, client.inbound_flow_control_window,
                     dict(server.streams), dict(server._closed_streams))
    assert seen["whole"] == seen["h2"]
    expected = [(b":status", str(response.status).encode())]
    if response.content_type:
        expected.append((b"content-type", response.content_type.encode()))
    assert seen["whole"][0][0][2] == expected


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    size = len(payload)
    return struct.pack(">BHBBL", size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


LATE_FRAMES = {   # what a client may still send on a stream its answer has ended
    "window update": _frame(0x8, 0x0, 1, struct.pack(">L", 100)),
    "reset": _frame(0x3, 0x0, 1, struct.pack(">L", 0x8)),
    "data": _frame(0x0, 0x1, 1, b"late"),
    "headers": _frame(0x1, 0x5, 1, h2.connection.H2Connection().encoder.encode([(b":method", b"GET")])),
    "priority": _frame(0x2, 0x0, 1, struct.pack(">LB", 0, 15)),
}


@pytest.mark.parametrize("late", list(LATE_FRAMES))
def test_a_stream_ended_by_a_whole_answer_meets_late_frames_as_after_h2s_count(late):
    """h2 takes a closed stream out of its streams when it next counts them (at a new
    stream); send_whole_answer does so at once. A frame that still comes for the stream
    meets what it meets in h2 after that count: the same events, bytes and error."""
    seen = {}
    for way in ("whole", "h2"):
        client, server = _pair()
        stream_id = _request(client, server)
        _answer(server, stream_id, Response(200, b"x"), way)
        if way == "h2":
            assert server.open_inbound_streams == 0
        _exchange(client, server)
        try:
            events, error = [repr(e) for e in server.receive_data(LATE_FRAMES[late])], None
        except h2.exceptions.ProtocolError as exc:
            events, error = [], (type(exc).__name__, str(exc))
        seen[way] = (events, error, server.data_to_send(), dict(server.streams), dict(server._closed_streams),
                     server.state_machine.state)
    assert seen["whole"] == seen["h2"]


def test_answer_block_leaves_the_clients_table_alone():
    client, server = _pair()
    stream_id = _request(client, server)
    table_before = list(client.decoder.header_table.dynamic_entries)
    assert server.send_whole_answer(stream_id, answer_block(Response(200, b"x")), b"x")
    _exchange(client, server)
    assert list(client.decoder.header_table.dynamic_entries) == table_before


def test_a_body_over_the_window_is_left_to_h2_with_nothing_changed():
    client, server = _pair()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    _exchange(client, server)
    stream_id = _request(client, server)
    state = server.streams[stream_id].state_machine.state
    window = server.outbound_flow_control_window
    assert not server.send_whole_answer(stream_id, answer_block(Response(200, BODY)), BODY)
    assert server.streams[stream_id].state_machine.state == state
    assert server.outbound_flow_control_window == window
    assert server.data_to_send() == b""
    assert server.send_whole_answer(stream_id, answer_block(Response(200, b"small")), b"small")


def test_a_table_size_change_is_left_to_h2s_encoder():
    """The next header block must start with the size update (RFC 7541 4.2): h2 codes it."""
    client, server = _pair()
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    _exchange(client, server)
    stream_id = _request(client, server)
    assert not server.send_whole_answer(stream_id, answer_block(Response(200, b"x")), b"x")
    server.send_headers(stream_id, response_headers(Response(200, b"x")))
    server.send_data(stream_id, b"x", end_stream=True)
    _exchange(client, server)
    later = _request(client, server)
    assert server.send_whole_answer(later, answer_block(Response(200, b"y")), b"y")
    assert ("data", later, b"y") in received(_exchange(client, server))


def test_a_stream_reset_by_the_client_raises_as_h2_would():
    client, server = _pair()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v"),
                                    (b":path", b"/v1/x")], end_stream=False)
    client.reset_stream(stream_id)
    _exchange(client, server)
    with pytest.raises(h2.exceptions.StreamClosedError):
        server.send_whole_answer(stream_id, answer_block(Response(200, b"x")), b"x")
    assert not server.send_whole_answer(stream_id + 2, answer_block(Response(200, b"x")), b"x")   # never opened


def test_answers_with_headers_of_their_own_are_h2s():
    assert answer_block(Response(429, b"x", headers=(("retry-after", "1"),))) is None
    assert answer_block(Response(200, b"x")) is answer_block(Response(200, b"other body"))


def test_ended_streams_are_remembered_within_h2s_limit_as_after_its_count():
    """h2 remembers how the last MAX_CLOSED_STREAMS closed streams ended, the oldest
    forgotten first: a stream a whole answer ends goes into that record as h2's count puts
    it there."""
    seen = {}
    for way in ("whole", "h2"):
        client, server = _pair()
        server._closed_streams._size_limit = 2
        for _ in range(4):
            stream_id = _request(client, server)
            _answer(server, stream_id, Response(200, b"x"), way)
            if way == "h2":
                assert server.open_inbound_streams == 0
            _exchange(client, server)
        seen[way] = (list(server._closed_streams.items()), dict(server.streams))
    assert seen["whole"] == seen["h2"]
    assert [stream_id for stream_id, _ in seen["whole"][0]] == [5, 7]
