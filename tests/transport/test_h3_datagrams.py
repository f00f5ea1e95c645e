"""HTTP/3 costs one datagram each way per request (quic_lean.py), without holding back bulk data.

Counted in QUIC packets (after the handshake every 1-RTT packet is its own datagram), on the
server's and the client's connection, over real mutual-TLS connections on loopback. With
aioquic's defaults a request answered after a few milliseconds took three packets each way
(the data, a QPACK decoder-stream acknowledgement, an ACK-only packet).
"""

from __future__ import annotations

import asyncio

import cbor2
from transport_support import PROPOSAL, RecordingRouter, run

from sdcp_fast.transport import Client, serve


def _connections(server, client):
    (server_side,) = server.connections
    (client_side,) = client._origins._connections.values()
    return server_side, client_side


def _sent(connection) -> int:
    return connection._quic._packet_number   # packets sent so far (private in aioquic 1.7.2)


def test_a_request_answered_after_milliseconds_takes_one_datagram_each_way(pki):
    """The ACK of the request rides on the answer and the ACK of the answer on the next
    request; no QPACK decoder-stream packets (the dynamic table is off)."""
    requests = 40

    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
            async with Client(pki.drafter, "h3", timeout=5.0) as client:
                url = f"https://127.0.0.1:{server.port}/slow?s=0.003"   # longer than aioquic's 1 ms ACK delay
                assert (await client.request("GET", url)).status == 204
                await asyncio.sleep(0.05)   # the handshake's last packets settle
                server_side, client_side = _connections(server, client)
                server_before, client_before = _sent(server_side), _sent(client_side)
                for _ in range(requests):
                    assert (await client.request("GET", url)).status == 204
                return _sent(server_side) - server_before, _sent(client_side) - client_before

    server_sent, client_sent = run(main())
    # exactly one each way when nothing stalls; a loaded machine may let a 10 ms ACK timer fire
    assert requests <= server_sent <= requests * 1.25
    assert requests <= client_sent <= requests * 1.25


def test_answers_of_one_loop_turn_share_datagrams(pki):
    concurrent = 32

    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
            async with Client(pki.drafter, "h3", timeout=5.0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                assert (await client.request("POST", url, PROPOSAL)).status == 200
                await asyncio.sleep(0.05)
                server_side, client_side = _connections(server, client)
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
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http2=False) as server:
            async with Client(pki.drafter, "h3", timeout=10.0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                assert (await client.request("POST", url, PROPOSAL)).status == 200
                await asyncio.sleep(0.05)
                server_side, client_side = _connections(server, client)
                server_before, client_before = _sent(server_side), _sent(client_side)
                answer = await client.request("POST", url, body)
                assert answer.status == 200
                assert cbor2.loads(answer.body)["echo"] == {"blob": b"\x00" * 400_000}
                return _sent(server_side) - server_before, _sent(client_side) - client_before

    server_sent, client_sent = run(main())
    assert client_sent >= len(body) // 1400   # the upload's datagrams
    assert server_sent >= client_sent // 3     # ACKs: about one per two datagrams (plus the answer's)
