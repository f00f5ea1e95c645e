"""The HTTP/2 client's request in one go (ClientConnection.send_whole_request): the server
sees what h2's own send_headers + send_data would have sent, both ends' books move the same
way, closed streams stay bounded, and what it does not take is left to h2. Sans-IO."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from transport_h2pair import exchange, received

from sdcp_fast.transport import client_h2
from sdcp_fast.transport.client_h2 import ClientConnection, _request_headers, request_block
from sdcp_fast.transport.h2_lean import lean_config

BODY = bytes(range(256)) * 2
PATH = "/v1/sessions/ab/proposals"
TYPE = "application/sdcp+cbor"


def _pair(max_streams: int | None = None) -> tuple[ClientConnection, h2.connection.H2Connection]:
    client = ClientConnection(lean_config(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    if max_streams is not None:
        server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    _exchange(client, server)
    return client, server


def _exchange(client, server) -> list[h2.events.Event]:
    """Move bytes both ways until quiet; the server's events."""
    return exchange(client, server)[1]


def _answer(server, stream_id):
    server.send_headers(stream_id, [(b":status", b"200")])
    server.send_data(stream_id, b"ok", end_stream=True)


def test_the_server_sees_what_h2s_own_path_sends():
    seen = {}
    for way in ("whole", "h2"):
        client, server = _pair()
        requests = []
        for body in (BODY, b"", None):
            stream_id = client.get_next_available_stream_id()
            content_type = None if body is None else TYPE
            if way == "whole":
                assert client.send_whole_request(stream_id, request_block("POST", "v", PATH, content_type),
                                                 body or b"", b"POST", b"v")
            else:
                client.send_headers(stream_id, _request_headers("POST", "v", PATH, body, content_type),
                                    end_stream=not body)
                if body:
                    client.send_data(stream_id, body, end_stream=True)
            requests += received(_exchange(client, server))
            _answer(server, stream_id)
            _exchange(client, server)
            assert client.streams[stream_id].closed
        seen[way] = (requests, client.outbound_flow_control_window, server.inbound_flow_control_window,
                     client.highest_outbound_stream_id)
    assert seen["whole"] == seen["h2"]
    assert seen["whole"][0][0][2] == [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v"),
                                      (b":path", PATH.encode()), (b"content-type", TYPE.encode())]


def test_closed_streams_are_pruned_and_the_limit_kept():
    client, server = _pair(max_streams=3)
    block = request_block("POST", "v", PATH, TYPE)
    for _ in range(100):   # answered one by one: never more than one open
        stream_id = client.get_next_available_stream_id()
        assert client.send_whole_request(stream_id, block, b"x", b"POST", b"v")
        _exchange(client, server)
        _answer(server, stream_id)
        _exchange(client, server)
    assert len(client.streams) <= client.PRUNE_EVERY + 1
    for _ in range(3):   # unanswered: up to the server's limit
        stream_id = client.get_next_available_stream_id()
        assert client.send_whole_request(stream_id, block, b"x", b"POST", b"v")
    stream_id = client.get_next_available_stream_id()
    assert not client.send_whole_request(stream_id, block, b"x", b"POST", b"v")
    assert stream_id not in client.streams
    with pytest.raises(h2.exceptions.TooManyStreamsError):   # h2's own path refuses it too
        client.send_headers(stream_id, _request_headers("POST", "v", PATH, b"x", TYPE))


def test_a_body_over_the_window_or_a_closed_connection_is_left_to_h2():
    client, server = _pair()
    server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    _exchange(client, server)
    stream_id = client.get_next_available_stream_id()
    assert not client.send_whole_request(stream_id, request_block("POST", "v", PATH, TYPE), BODY, b"POST", b"v")
    assert stream_id not in client.streams and client.data_to_send() == b""
    client.close_connection()
    assert not client.send_whole_request(stream_id, request_block("POST", "v", PATH, TYPE), b"x", b"POST", b"v")
    assert stream_id not in client.streams


def test_request_blocks_are_coded_once_and_bounded():
    assert request_block("POST", "v", PATH, TYPE) is request_block("POST", "v", PATH, TYPE)
    for n in range(1100):
        request_block("POST", "v", f"/v1/{n}", TYPE)
    assert len(client_h2._REQUEST_BLOCKS) <= client_h2._REQUEST_BLOCKS_MAX
