"""Bounded memory per HTTP/2 connection (issue 21's soak): libnghttp2 keeps nothing of a
closed stream, on our server's connections and on our client's, though the server's own
SETTINGS_MAX_CONCURRENT_STREAMS (which would bound what it keeps) is left at its default (we
advertise and enforce the limit ourselves, server_h2.py); a late frame on any closed stream
is still a stream matter, never a connection error."""

from __future__ import annotations

import ngh2

from sdcp_fast.transport.h2base import ErrorCodes, frame


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4


def test_closed_streams_leave_nothing_behind_on_both_ends():
    client = ngh2.Connection(ngh2.Role.CLIENT)
    server = ngh2.Connection(ngh2.Role.SERVER, ngh2.Configuration(max_inbound_header_list_size=1 << 16))
    client.initiate_connection({ngh2.Setting.ENABLE_PUSH: 0})
    server.initiate_connection({ngh2.Setting.MAX_HEADER_LIST_SIZE: 16384, ngh2.Setting.ENABLE_PUSH: 0})
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    request = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/")]

    def exchanges(count: int) -> int:
        answered = 0
        for n in range(count):
            client.send_request(request, end_stream=True)
            server.receive_data(client.data_to_send())
            for event in server.events():
                if isinstance(event, ngh2.RequestReceived):
                    if n % 2:
                        server.send_response(event.stream_id, [(b":status", b"204")], end_stream=True)
                    else:                       # closed by a reset: what late frames are checked against
                        server.reset_stream(event.stream_id, ErrorCodes.CANCEL)
            client.receive_data(server.data_to_send())
            answered += sum(isinstance(e, ngh2.ResponseReceived | ngh2.StreamReset) for e in client.events())
            server.receive_data(client.data_to_send())
            server.events()
        return answered

    assert exchanges(5000) == 5000
    before = _rss_kib()
    assert exchanges(20_000) == 20_000
    assert _rss_kib() - before < 2048   # kept closed streams would take several MiB
    # late DATA on the first and on the latest reset stream: ignored, the connection goes on
    latest = client.next_stream_id - 4
    for stream_id in (1, latest):
        server.receive_data(frame(0x0, b"late")[:5] + stream_id.to_bytes(4, "big") + b"late")
    assert not any(isinstance(e, ngh2.ConnectionClosed) for e in server.events())
    assert server.want_read and exchanges(2) == 2


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
