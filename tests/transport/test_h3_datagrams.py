"""HTTP/3 costs one datagram each way per request (quic_lean.py), without holding back bulk data.

Counted in QUIC packets (after the handshake every 1-RTT packet is its own datagram), on the
server's and the client's connection, over real mutual-TLS connections on loopback. With
aioquic's defaults a request answered after a few milliseconds took three packets each way
(the data, a QPACK decoder-stream acknowledgement, an ACK-only packet).
"""

from __future__ import annotations

import asyncio
import contextlib

import cbor2
import pytest
from transport_support import PROPOSAL, RecordingRouter, run

from sdcp_fast.transport import Client, serve


def _connections(server, client):
    (server_side,) = server.connections
    (client_side,) = client._origins._connections.values()
    return server_side, client_side


def _sent(connection) -> int:
    return connection._quic._packet_number   # packets sent so far (private in aioquic 1.7.2)


@contextlib.asynccontextmanager
async def _settled(pki, path: str = "/proposals", *, timeout: float = 5.0):
    """A server and a client over HTTP/3 with one request of `path` answered (a GET of a
    `/slow` path, else a proposal) and the handshake's last packets settled: (client, url,
    the server's connection, the client's connection)."""
    async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
        async with Client(pki.drafter, "h3", timeout=timeout) as client:
            url = f"https://127.0.0.1:{server.port}{path}"
            if path.startswith("/slow"):
                assert (await client.request("GET", url)).status == 204
            else:
                assert (await client.request("POST", url, PROPOSAL)).status == 200
            await asyncio.sleep(0.05)   # the handshake's last packets settle
            yield (client, url, *_connections(server, client))


def test_a_request_answered_after_milliseconds_takes_one_datagram_each_way(pki):
    """The ACK of the request rides on the answer and the ACK of the answer on the next
    request; no QPACK decoder-stream packets (the dynamic table is off)."""
    requests = 40

    async def main():
        # the answer waits longer than aioquic's 1 ms ACK delay
        async with _settled(pki, "/slow?s=0.003") as (client, url, server_side, client_side):
            server_before, client_before = _sent(server_side), _sent(client_side)
            for _ in range(requests):
                assert (await client.request("GET", url)).status == 204
            return _sent(server_side) - server_before, _sent(client_side) - client_before

    server_sent, client_sent = run(main())
    # exactly one each way when nothing stalls; a loaded machine may let a 10 ms ACK timer fire
    assert requests <= server_sent <= requests * 1.25
    assert requests <= client_sent <= requests * 1.25


def _count_ack_frames(connection) -> list[int]:
    """[ACK frames written so far] on `connection` (aioquic's private writer, wrapped)."""
    quic, counted = connection._quic, [0]
    write = quic._write_ack_frame

    def counting(*args, **kwargs):
        counted[0] += 1
        return write(*args, **kwargs)

    quic._write_ack_frame = counting
    return counted


@pytest.mark.parametrize("pause", [0.0, 0.025])
def test_a_quick_exchange_carries_an_ack_in_every_second_packet_each_way(pki, pause):
    """Requests sent one after another (pause 0): an ACK rides on every second request and
    every second answer, each for two packets (quic_lean.LeanAcks.ack_with_data), and none
    leaves alone. A drafter that pauses longer than a lone ACK may wait: every answer carries
    its request's ACK again, still without a datagram of its own from the server."""
    requests = 40

    async def main():
        async with _settled(pki) as (client, url, server_side, client_side):
            server_acks, client_acks = _count_ack_frames(server_side), _count_ack_frames(client_side)
            server_before = _sent(server_side)
            for _ in range(requests):
                assert (await client.request("POST", url, PROPOSAL)).status == 200
                await asyncio.sleep(pause)
            return _sent(server_side) - server_before, server_acks[0], client_acks[0]

    server_sent, server_acks, client_acks = run(main())
    assert server_sent <= requests * 1.25
    if pause:
        assert server_acks >= requests * 0.9
    else:   # about half; a loaded machine may space some requests more than QUICK_PEER apart
        assert server_acks <= requests * 0.75
        assert client_acks <= requests * 0.75


def test_answers_of_one_loop_turn_share_datagrams(pki):
    concurrent = 32

    async def main():
        async with _settled(pki) as (client, url, server_side, client_side):
            server_before, client_before = _sent(server_side), _sent(client_side)
            answers = await asyncio.gather(*(client.request("POST", url, PROPOSAL) for _ in range(concurrent)))
            assert [a.status for a in answers] == [200] * concurrent
            return _sent(server_side) - server_before, _sent(client_side) - client_before

    server_sent, client_sent = run(main())
    # a request (~300 bytes) or an answer (~250) each: four or so share a 1,200-byte datagram
    assert client_sent <= concurrent // 2
    assert server_sent <= concurrent // 2


def test_a_bulk_upload_is_acknowledged_every_second_datagram(pki):
    """Delaying ACKs must not starve a sender of its congestion window: a datagram arriving
    while an ACK is owed is acknowledged at once (RFC 9000 13.2.2)."""
    body = cbor2.dumps({"blob": b"\x00" * 400_000})

    async def main():
        async with _settled(pki, timeout=10.0) as (client, url, server_side, client_side):
            server_before, client_before = _sent(server_side), _sent(client_side)
            answer = await client.request("POST", url, body)
            assert answer.status == 200
            assert cbor2.loads(answer.body)["echo"] == {"blob": b"\x00" * 400_000}
            return _sent(server_side) - server_before, _sent(client_side) - client_before

    server_sent, client_sent = run(main())
    assert client_sent >= len(body) // 1400   # the upload's datagrams
    assert server_sent >= client_sent // 3     # ACKs: about one per two datagrams (plus the answer's)


def test_the_server_routes_datagrams_as_aioquics_server_does():
    """server_h3.H3Server hands a 1-RTT datagram to its connection without parsing its header;
    what reaches which connection, and what the server sends itself, stay aioquic's."""
    from aioquic.asyncio.server import QuicServer
    from aioquic.quic.configuration import QuicConfiguration

    from sdcp_fast.transport.server_h3 import H3Server

    cid = bytes(range(1, 9))   # connection_id_length: 8
    datagrams = [
        b"\x40" + cid + b"payload",   # short header, known connection
        b"\x7f" + cid,                # ... with nothing after the ID
        b"\x40" + cid[:7],            # too short for the ID
        b"\x00" + cid + b"payload",   # fixed bit 0
        b"\x40" + bytes(8) + b"x",    # an unknown ID
        b"",
        b"\xe0\x00\x00\x00\x01\x08" + cid + b"\x00\x05hello",               # a Handshake packet, long header
        b"\xc0\x0a\x0a\x0a\x0a\x08" + cid + b"\x00" + bytes(1200),          # an unknown version: negotiation
    ]

    class Connection:
        def __init__(self):
            self.received: list[bytes] = []

        def datagram_received(self, data, addr) -> None:
            self.received.append(data)

    class Transport:
        def __init__(self):
            self.sent: list[int] = []

        def sendto(self, data, addr) -> None:
            self.sent.append(len(data))

    async def main(server_class):
        server = server_class(configuration=QuicConfiguration(is_client=False), retry=False)
        transport, connection = Transport(), Connection()
        server.connection_made(transport)
        server._protocols[cid] = connection
        for data in datagrams:
            server.datagram_received(data, ("127.0.0.1", 4433))
        return connection.received, transport.sent

    assert run(main(H3Server)) == run(main(QuicServer)) == ([datagrams[0], datagrams[1], datagrams[6]], [23])
