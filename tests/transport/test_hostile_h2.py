"""HTTP/2 under a hostile client (the `h2` package driving a TLS socket), one test per defect
of issue 22: each refusal stays on its own stream or connection, the other streams and
connections keep working, and every refusal is counted by kind."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import h2.errors
import h2.settings
import httpx
import pytest
from transport_rawh2 import RawH2
from transport_support import (
    CBOR,
    PROPOSAL,
    RecordingRouter,
    assert_serves,
    run,
    ssl_client_context,
)

from sdcp_fast.transport import SDCP_MEDIA_TYPE, serve

E = h2.errors.ErrorCodes


def _serve(handler, pki, **limits):
    return serve(handler, host="127.0.0.1", port=0, tls=pki.server, http3=False, **limits)


async def _refused_for_a_while(server, identity) -> None:
    """A client told to calm down comes straight back: refused, with ENHANCE_YOUR_CALM."""
    again = await RawH2.open(server.port, identity)
    await again.run_until_closed()
    assert again.goaway is not None and again.goaway.error_code == E.ENHANCE_YOUR_CALM
    assert server.refusals.counts["calm_penalty"] == 1


MALFORMED = {
    "uppercase-name": dict(headers=[(b"X-Upper", b"1")]),
    "connection-header": dict(headers=[(b"connection", b"close")]),
    "content-length-mismatch": dict(headers=[*CBOR, (b"content-length", b"100")], body=PROPOSAL),
    "content-length-not-a-number": dict(headers=[*CBOR, (b"content-length", b"12x")], body=PROPOSAL),
    "pseudo-after-regular": dict(headers=[(b"x-a", b"1"), (b":authority", b"again")]),
    "value-with-newline": dict(headers=[(b"x-a", b"1\r\nx-b: 2")]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_request_resets_only_its_stream(pki, case):
    """RFC 9113 8.1.1: a stream error. Before the fix, h2 sent GOAWAY and the long-poll died."""
    handler = RecordingRouter()

    async def main():
        async with await _serve(handler, pki) as server:
            client = await RawH2.open(server.port, pki.drafter)
            long_poll = client.request("GET", "/slow?s=0.5")
            await asyncio.sleep(0.1)   # the long poll is in flight
            bad = client.request("POST", "/proposals", **MALFORMED[case])
            await client.until(lambda c: c.done(bad) and c.done(long_poll))
            assert client.streams[bad].reset == E.PROTOCOL_ERROR
            assert client.streams[bad].status is None
            assert client.streams[long_poll].status == 204 and client.streams[long_poll].reset is None
            assert client.goaway is None
            await assert_serves(client)   # the same connection
            assert server.refusals.counts["malformed"] == 1
            await client.close()

    run(main())
    assert [c.path for c in handler.calls] == ["/slow", "/proposals"]


def test_head_carries_no_content(pki):
    """RFC 9110 9.3.2; before the fix a 405 document followed as DATA and httpx failed."""

    async def main():
        async with await _serve(RecordingRouter(), pki) as server:
            client = await RawH2.open(server.port, pki.drafter)
            head = client.request("HEAD", "/proposals")
            await client.until(lambda c: c.done(head))
            log = client.streams[head]
            assert (log.status, log.data_frames, log.body, log.ended) == (405, 0, b"", True)
            assert b"content-length" not in log.headers
            await client.close()
            async with httpx.AsyncClient(http1=False, http2=True, timeout=5.0, trust_env=False,
                                         verify=ssl_client_context(str(pki.server.ca), *_files(pki))) as conforming:
                response = await conforming.head(f"https://127.0.0.1:{server.port}/proposals")
                assert (response.status_code, response.content) == (405, b"")
                follow = await conforming.post(f"https://127.0.0.1:{server.port}/proposals",
                                               content=PROPOSAL, headers={"content-type": SDCP_MEDIA_TYPE})
                assert follow.status_code == 200

    run(main())


def _files(pki):
    return str(pki.drafter.cert), str(pki.drafter.key)


def test_oversized_header_list_is_refused_431_and_the_connection_goes_on(pki):
    """The advertised SETTINGS_MAX_HEADER_LIST_SIZE is enforced (before: 60,000 bytes passed)."""

    async def main():
        async with await _serve(RecordingRouter(), pki, max_header_list=16384) as server:
            client = await RawH2.open(server.port, pki.drafter)
            await client.until(lambda c: c.remote_settings)
            assert client.remote_settings[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == 16384
            big = client.request("POST", "/proposals", [*CBOR, (b"x-pad", b"p" * 60_000)], PROPOSAL)
            await client.until(lambda c: c.done(big))
            log = client.streams[big]
            assert log.status == 431
            assert json.loads(log.body)["type"].endswith("headers-too-large")
            await assert_serves(client)
            # far beyond it HPACK stops decoding: a connection error, ENHANCE_YOUR_CALM
            client.request("POST", "/proposals", [*CBOR, (b"x-pad", b"p" * 300_000)], PROPOSAL)
            await client.run_until_closed()
            assert client.goaway is not None and client.goaway.error_code == E.ENHANCE_YOUR_CALM
            assert server.refusals.counts["headers_too_large"] == 2
            # ... and the client may not come straight back for another decode of that size
            await _refused_for_a_while(server, pki.drafter)

    run(main())




def test_window_zero_stream_is_reset_after_send_timeout(pki):
    """A client that grants no flow-control credit (INITIAL_WINDOW_SIZE 0) no longer holds a
    stream forever: after send_timeout it is reset (CANCEL); other streams go on."""

    async def main():
        async with await _serve(RecordingRouter(), pki, send_timeout=0.3) as server:
            client = await RawH2.open(server.port, pki.drafter, initial_window=0)
            stalled = client.request("POST", "/proposals", CBOR, PROPOSAL)
            empty = client.request("GET", "/slow?s=0")   # 204: no body, needs no credit
            await client.until(lambda c: c.done(empty))
            assert client.streams[empty].status == 204
            await client.until(lambda c: c.done(stalled), timeout=3.0)
            log = client.streams[stalled]
            assert (log.status, log.body, log.reset) == (200, b"", E.CANCEL)
            assert client.goaway is None and not client.closed
            assert server.refusals.counts["flow_stalled"] == 1
            await client.close()

    run(main())


def test_streams_over_the_concurrency_limit_are_refused(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_concurrent_streams=2) as server:
            client = await RawH2.open(server.port, pki.drafter)
            await client.until(lambda c: c.remote_settings)
            assert client.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 2
            client.conn._open_streams = lambda remainder: 0   # h2 would keep the client within it
            slow = [client.request("GET", "/slow?s=0.3") for _ in range(3)]
            await client.until(lambda c: all(c.done(s) for s in slow))
            assert [client.streams[s].status for s in slow] == [204, 204, None]
            assert client.streams[slow[2]].reset == E.REFUSED_STREAM
            assert client.goaway is None
            assert server.refusals.counts["stream_limit"] == 1
            await client.close()

    run(main())


def test_rapid_reset_ends_the_connection_with_enhance_your_calm(pki):
    """The 2023 rapid-reset pattern: open and reset streams. Past max_early_resets the
    connection ends with ENHANCE_YOUR_CALM, the identity is refused for calm_penalty_s, and
    another client is served throughout."""
    handler = RecordingRouter()

    async def main():
        async with await _serve(handler, pki, max_early_resets=50, calm_penalty_s=30) as server:
            bystander = await RawH2.open(server.port, pki.router)
            attacker = await RawH2.open(server.port, pki.drafter)
            for _ in range(200):
                sid = attacker.request("POST", "/proposals", CBOR, PROPOSAL)
                attacker.reset(sid)
                if attacker.writer.is_closing():
                    break
            await attacker.run_until_closed()
            assert attacker.goaway is not None and attacker.goaway.error_code == E.ENHANCE_YOUR_CALM
            assert server.refusals.counts["rapid_reset"] == 1
            await assert_serves(bystander)
            # the same identity is refused for a while, with a reason
            await _refused_for_a_while(server, pki.drafter)
            await bystander.close()

    run(main())
    assert len(handler.calls) < 60   # most reset streams never reached the handler


def test_a_client_that_keeps_sending_bad_requests_is_told_to_calm_down(pki):
    """Each request refused as malformed or over a limit (400 from the role, 415 and 431 from
    the transport) costs the server a header decode, and the 400 a body decode: past
    max_refused_requests within the window the connection ends with ENHANCE_YOUR_CALM and
    the identity waits calm_penalty_s, while another client is served throughout."""
    bad = [([*CBOR], b"\xff"),                                     # not CBOR: 400 from the role
           ([], PROPOSAL),                                          # no content type: 415
           ([*CBOR, (b"x-pad", b"p" * 20_000)], PROPOSAL)]          # header list: 431

    async def main():
        async with await _serve(RecordingRouter(), pki, max_refused_requests=6, calm_penalty_s=30) as server:
            bystander = await RawH2.open(server.port, pki.router)
            attacker = await RawH2.open(server.port, pki.drafter)
            statuses = []
            for n in range(6):
                headers, body = bad[n % 3]
                sid = attacker.request("POST", "/proposals", headers, body)
                await attacker.until(lambda c, sid=sid: c.done(sid))
                statuses.append(attacker.streams[sid].status)
            assert statuses == [400, 415, 431] * 2
            assert attacker.goaway is None
            attacker.request("POST", "/proposals", [*CBOR], b"\xff")   # one over the budget
            await attacker.run_until_closed()
            assert attacker.goaway is not None and attacker.goaway.error_code == E.ENHANCE_YOUR_CALM
            assert attacker.goaway.additional_data == b"refused_requests"
            assert server.refusals.counts["refused_requests"] == 1
            await assert_serves(bystander)
            await _refused_for_a_while(server, pki.drafter)
            await bystander.close()

    run(main())


def test_connections_over_the_caps_are_refused_and_existing_ones_keep_working(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_connections=3,
                                max_connections_per_client=2) as server:
            first = [await RawH2.open(server.port, pki.drafter) for _ in range(2)]
            third = await RawH2.open(server.port, pki.drafter)   # over the per-client cap
            await third.run_until_closed()
            assert third.goaway.error_code == E.ENHANCE_YOUR_CALM
            assert b"max_connections_per_client" in third.goaway.additional_data
            router = await RawH2.open(server.port, pki.router)   # another identity: fits
            other = await RawH2.open(server.port, pki.router)    # over the total cap
            await other.run_until_closed()
            assert other.goaway.error_code == E.NO_ERROR and other.goaway.last_stream_id == 0
            assert b"max_connections" in other.goaway.additional_data
            for client in [*first, router]:
                await assert_serves(client)
                await client.close()
            assert server.refusals.counts["client_connections"] == 1
            assert server.refusals.counts["connections"] == 1

    run(main())


def test_idle_tcp_connections_cannot_lock_out_clients(pki):
    """2,000 idle TCP connections used to be held: now at most max_handshakes wait for their
    handshake (the oldest is dropped for a newcomer), each at most handshake_timeout, and
    a real client still gets in while they are open."""

    async def main():
        async with await _serve(RecordingRouter(), pki, max_handshakes=8, handshake_timeout=1.0) as server:
            idle = []
            for _ in range(40):
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.setblocking(False)
                idle.append(sock)
            await asyncio.sleep(0.2)
            assert len(server.serving.handshakes) <= 8
            client = await RawH2.open(server.port, pki.drafter)   # a real handshake: gets in
            await assert_serves(client)
            assert server.refusals.counts["handshake_dropped"] >= 32
            await asyncio.sleep(1.3)   # the rest time out
            assert not server.serving.handshakes
            assert server.refusals.counts["handshake_dropped"] + server.refusals.counts["handshake_timeout"] >= 40
            closed = 0
            for sock in idle:
                try:
                    closed += sock.recv(1) == b""
                except (BlockingIOError, ConnectionError):
                    closed += 1
                sock.close()
            assert closed == 40
            await client.close()

    run(main())


def test_stalled_preface_and_partial_frames_hit_the_header_timeout(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, header_timeout=0.3) as server:
            silent = await RawH2.open(server.port, pki.drafter, preface=False)   # TLS, then nothing
            partial = await RawH2.open(server.port, pki.drafter)
            await partial.until(lambda c: c.remote_settings)
            # a HEADERS frame header announcing 100 bytes, then 10 of them: never completed (the
            # start of a literal field whose 50-byte name is still to come: a decoder that reads
            # a block as it arrives, libnghttp2's, must wait as well)
            partial.write_raw(bytes([0, 0, 100, 1, 4, 0, 0, 0, 1, 0, 50]) + b"a" * 8)
            await asyncio.wait_for(asyncio.gather(silent.run_until_closed(), partial.run_until_closed()), 3.0)
            assert server.refusals.counts["header_timeout"] == 2

    run(main())


def test_a_host_reconnecting_in_a_loop_is_refused_before_tls(pki):
    """Past its burst, a host's new connections are dropped before the handshake (a client
    told to calm down that reconnects at once must not cost a handshake each time)."""

    async def main():
        # a refill of one connection per 100 s: none within the test, however slow its handshakes
        async with await _serve(RecordingRouter(), pki, new_connections_burst=5,
                                new_connections_per_host_s=0.01) as server:
            kept = await RawH2.open(server.port, pki.router)
            opened = [await RawH2.open(server.port, pki.drafter) for _ in range(4)]   # the burst
            with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
                await RawH2.open(server.port, pki.drafter)
            assert server.refusals.counts["connection_rate"] == 1
            await assert_serves(kept)   # open connections go on
            for client in [kept, *opened]:
                await client.close()

    run(main())


def test_frame_edges_take_out_only_the_acknowledgement_of_our_settings():
    """The client's first SETTINGS ACK answers our own SETTINGS frame (libnghttp2 did not send
    it): taken out of the input however the reads split it; everything else passes as it came."""
    from sdcp_fast.transport.h2base import settings_frame
    from sdcp_fast.transport.server_h2 import FrameEdges

    ack = bytes([0, 0, 0, 4, 1, 0, 0, 0, 0])
    ping = bytes([0, 0, 8, 6, 0, 0, 0, 0, 0]) + b"12345678"
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings_frame({3: 100})
    wire = preface + ping + ack + ping + ack + ping
    expected = preface + ping + ping + ack + ping
    for size in (1, 2, 5, 9, 13, len(wire)):
        edges = FrameEdges(1 << 16)
        out = b"".join(edges.feed(wire[at:at + size]) for at in range(0, len(wire), size))
        assert out == expected and not edges.partial and not edges.oversized, size
    edges = FrameEdges(100)   # a header block whose frames pass the budget, HEADERS + CONTINUATION
    edges.feed(preface + bytes([0, 0, 60, 1, 0, 0, 0, 0, 1]) + bytes(60) + bytes([0, 0, 60, 9, 4, 0, 0, 0, 1]))
    assert edges.oversized
