"""Bounded memory per HTTP/2 connection (issue 21's soak): h2 remembers how closed streams
ended for at most H2_CLOSED_STREAMS_KEPT streams per connection, on our server's connections
and on our client's (h2's public MAX_CLOSED_STREAMS, set on our subclasses only)."""

from __future__ import annotations

import jh2.config
import jh2.connection
import jh2.events
import jh2.stream

from sdcp_fast.transport import H2_CLOSED_STREAMS_KEPT
from sdcp_fast.transport.compat import H2Connection, H2StreamErrors


def test_closed_streams_remembered_are_bounded_on_both_ends():
    client = H2Connection(jh2.config.H2Configuration(client_side=True, header_encoding=None))
    server = H2StreamErrors(jh2.config.H2Configuration(client_side=False, header_encoding=None,
                                                        validate_inbound_headers=False))
    client.local_settings.max_concurrent_streams = server.local_settings.max_concurrent_streams = 10
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    request = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/")]
    streams = H2_CLOSED_STREAMS_KEPT + 600
    answered = 0
    for n in range(streams):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, request, end_stream=True)
        for event in server.receive_data(client.data_to_send()):
            if isinstance(event, jh2.events.RequestReceived):
                if n % 2:
                    server.send_headers(event.stream_id, [(b":status", b"204")], end_stream=True)
                else:                       # closed by a reset: what late frames are checked against
                    server.reset_stream(event.stream_id)
        for event in client.receive_data(server.data_to_send()):
            answered += isinstance(event, jh2.events.ResponseReceived | jh2.events.StreamReset)
        server.receive_data(client.data_to_send())
    assert answered == streams
    assert len(client.streams) <= 2 and len(server.streams) <= 2
    for conn in (client, server):
        assert len(conn._closed_streams) == H2_CLOSED_STREAMS_KEPT   # full, and no more
    # the last streams' ends are still known: a late frame on the latest reset stream is a
    # stream error (RST_STREAM), not a connection error
    last_reset = max(sid for sid, how in server._closed_streams.items()
                     if how == jh2.stream.StreamClosedBy.SEND_RST_STREAM)
    assert server._stream_is_closed_by_reset(last_reset)


def test_a_connection_error_raised_for_every_queued_request_keeps_no_growing_traceback():
    """httpcore raises the one exception that broke an HTTP/2 connection for every request
    still queued on it; each raise would add that request's frames to its traceback (1,474
    entries in the soak's router). Client.request drops the tracebacks of a transport
    error's causes once caught, so the stored exception holds one raise's frames at most."""
    import asyncio

    from sdcp_fast.transport import Client, TransportError

    broke = ConnectionResetError("the connection broke")    # what httpcore keeps and raises again

    class BrokenConnection:
        async def open(self, url):
            return self, url, url

        async def request(self, method, url, path, body, content_type):
            try:
                await asyncio.sleep(0)
                raise broke
            except ConnectionResetError as exc:
                raise TransportError(f"{method} {url}: {exc}", sent=True) from exc

    def chain_length(exc):
        n, tb = 0, exc.__traceback__
        while tb is not None:
            n, tb = n + 1, tb.tb_next
        return n

    async def main():
        client = Client.__new__(Client)
        client.timeout, client.retries, client._origins = 5.0, 2, BrokenConnection()
        lengths = []
        for _ in range(50):
            results = await asyncio.gather(*(client.request("GET", "https://v.test/x") for _ in range(4)),
                                           return_exceptions=True)
            assert all(isinstance(r, TransportError) for r in results)
            lengths.append(chain_length(broke))
        return lengths

    lengths = asyncio.run(main())
    assert max(lengths) == 0        # dropped once caught: nothing accumulates
