"""HTTP/3 under a hostile client (aioquic driving QUIC directly): the limits of issue 22 held
the same way as on HTTP/2, each refusal on its own stream or connection, each counted."""

from __future__ import annotations

import asyncio
import json

import pytest
from aioquic.h3.connection import ErrorCode, Setting
from aioquic.quic.packet import QuicErrorCode
from transport_rawh3 import RawH3
from transport_support import CBOR, PROPOSAL, RecordingRouter, assert_serves, run

from sdcp_fast.transport import serve


def _serve(handler, pki, **limits):
    return serve(handler, host="127.0.0.1", port=0, tls=pki.server, http2=False, **limits)


@pytest.mark.parametrize("headers", [
    [(b"X-Upper", b"1")],
    [(b"connection", b"close")],
    [*CBOR, (b"content-length", b"100")],
], ids=["uppercase-name", "connection-header", "content-length-mismatch"])
def test_malformed_request_resets_only_its_stream(pki, headers):
    """RFC 9114 4.1.2: H3_MESSAGE_ERROR on the stream; aioquic alone closed the connection."""
    handler = RecordingRouter()

    async def main():
        async with await _serve(handler, pki) as server:
            client = await RawH3.open(server.port, pki.drafter)
            long_poll = client.request("GET", "/slow?s=0.5")
            await asyncio.sleep(0.1)
            bad = client.request("POST", "/proposals", headers, PROPOSAL)
            await client.until(lambda c: c.done(bad) and c.done(long_poll))
            assert client.streams[bad].reset == ErrorCode.H3_MESSAGE_ERROR
            assert client.streams[long_poll].status == 204
            await assert_serves(client)
            assert client.terminated is None
            assert server.refusals.counts["malformed"] == 1
            await client.aclose()

    run(main())
    assert [c.path for c in handler.calls] == ["/slow", "/proposals"]


def test_head_carries_no_content(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki) as server:
            client = await RawH3.open(server.port, pki.drafter)
            head = client.request("HEAD", "/proposals")
            await client.until(lambda c: c.done(head))
            log = client.streams[head]
            assert (log.status, log.data_frames, log.body, log.ended) == (405, 0, b"", True)
            await client.aclose()

    run(main())


def test_oversized_headers_are_refused_431_and_advertised(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_header_list=16384) as server:
            client = await RawH3.open(server.port, pki.drafter)
            big = client.request("POST", "/proposals", [*CBOR, (b"x-pad", b"p" * 60_000)], PROPOSAL)
            await client.until(lambda c: c.done(big))
            assert client.streams[big].status == 431
            assert json.loads(client.streams[big].body)["type"].endswith("headers-too-large")
            assert client.h3._received_settings[Setting.MAX_FIELD_SECTION_SIZE] == 16384
            await assert_serves(client)
            assert server.refusals.counts["headers_too_large"] == 1
            await client.aclose()

    run(main())


def test_quic_limits_are_announced(pki):
    """MAX_STREAMS, flow control and the idle timeout come from the limits."""

    async def main():
        async with await _serve(RecordingRouter(), pki, max_concurrent_streams=7, quic_max_data=300_000,
                                quic_max_stream_data=100_000, idle_timeout=42.0) as server:
            client = await RawH3.open(server.port, pki.drafter)
            quic = client._quic
            assert quic._remote_max_streams_bidi == 7
            assert quic._remote_max_data == 300_000
            assert quic._remote_max_stream_data_bidi_remote == 100_000
            assert quic._remote_max_idle_timeout == 42.0
            await client.aclose()

    run(main())


def test_rapid_reset_closes_the_connection_with_excessive_load(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_early_resets=30, calm_penalty_s=30) as server:
            bystander = await RawH3.open(server.port, pki.router)
            attacker = await RawH3.open(server.port, pki.drafter)
            for _ in range(100):
                if attacker.terminated is not None:
                    break
                # requests that take a moment, as a verifier's round does: an instant echo may
                # be answered before the reset arrives, and then the reset is not early
                sid = attacker.request("GET", "/slow?s=5")
                attacker.reset(sid)
                await asyncio.sleep(0)
            closed = await attacker.until_closed()
            assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD
            assert server.refusals.counts["rapid_reset"] == 1
            await assert_serves(bystander)
            await bystander.aclose()

    run(main())


def test_a_client_that_keeps_sending_bad_requests_is_told_to_calm_down(pki):
    """As on HTTP/2: past max_refused_requests answers of 400/413/415/431 within the window
    the connection ends with H3_EXCESSIVE_LOAD; another client is served throughout."""
    bad = [([*CBOR], b"\xff"), ([], PROPOSAL)]      # 400 from the role, 415 from the transport

    async def main():
        async with await _serve(RecordingRouter(), pki, max_refused_requests=4, calm_penalty_s=30) as server:
            bystander = await RawH3.open(server.port, pki.router)
            attacker = await RawH3.open(server.port, pki.drafter)
            statuses = []
            for n in range(4):
                headers, body = bad[n % 2]
                sid = attacker.request("POST", "/proposals", headers, body)
                await attacker.until(lambda c, sid=sid: c.done(sid))
                statuses.append(attacker.streams[sid].status)
            assert statuses == [400, 415] * 2
            assert attacker.terminated is None
            attacker.request("POST", "/proposals", [*CBOR], b"\xff")
            closed = await attacker.until_closed()
            assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD
            assert server.refusals.counts["refused_requests"] == 1
            await assert_serves(bystander)
            await bystander.aclose()

    run(main())


def test_connections_over_the_per_client_cap_are_refused(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_connections_per_client=2) as server:
            first = [await RawH3.open(server.port, pki.drafter) for _ in range(2)]
            third = await RawH3.open(server.port, pki.drafter)
            closed = await third.until_closed()
            assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD
            assert "max_connections_per_client" in closed.reason_phrase
            for client in first:
                await assert_serves(client)
                await client.aclose()
            assert server.refusals.counts["client_connections"] == 1

    run(main())


def test_a_stalled_header_block_is_reset_after_the_header_timeout(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, header_timeout=0.3) as server:
            client = await RawH3.open(server.port, pki.drafter)
            stalled = client._quic.get_next_available_stream_id()
            # a HEADERS frame announcing 100 bytes, then 10 of them
            client._quic.send_stream_data(stalled, bytes([0x01, 0x40, 0x64]) + b"\x00" * 10)
            client.transmit()
            await client.until(lambda c: c.done(stalled), timeout=3.0)
            assert client.streams[stalled].reset == ErrorCode.H3_REQUEST_INCOMPLETE
            await assert_serves(client)
            assert server.refusals.counts["header_timeout"] == 1
            await client.aclose()

    run(main())


def test_a_host_opening_quic_connections_too_fast_is_dropped_before_the_handshake(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, new_connections_burst=2,
                                new_connections_per_host_s=0.01) as server:   # no refill within the test
            first = [await RawH3.open(server.port, pki.drafter) for _ in range(2)]
            with pytest.raises((ConnectionError, TimeoutError)):
                await asyncio.wait_for(RawH3.open(server.port, pki.drafter), 1.0)
            assert server.refusals.counts["connection_rate"] >= 1
            assert len(set(server._quic._protocols.values())) == 2   # the dropped one is not kept
            for client in first:
                await client.aclose()

    run(main())


def test_window_zero_streams_are_reset_after_send_timeout(pki):
    """A client that grants no flow-control credit (QUIC max_stream_data 0) cannot even receive
    a HEADERS frame: after send_timeout each such stream is reset (H3_REQUEST_CANCELLED), with
    or without content, and a stream given credit on the same connection is answered."""

    async def main():
        async with await _serve(RecordingRouter(), pki, send_timeout=0.3) as server:
            client = await RawH3.open(server.port, pki.drafter, max_stream_data=0)
            stalled = client.request("POST", "/proposals", CBOR, PROPOSAL)
            empty = client.request("GET", "/slow?s=0")   # 204: no content, but HEADERS need credit
            await client.until(lambda c: c.done(stalled) and c.done(empty), timeout=3.0)
            for sid in (stalled, empty):
                log = client.streams[sid]
                assert (log.status, log.body, log.reset) == (None, b"", ErrorCode.H3_REQUEST_CANCELLED)
            good = client.request("POST", "/proposals", CBOR, PROPOSAL)
            client.grant(good)
            await client.until(lambda c: c.done(good))
            assert client.streams[good].status == 200
            assert client.streams[good].reset is None
            assert client.terminated is None
            assert server.refusals.counts["flow_stalled"] == 2
            await client.aclose()

    run(main())


class CountingRouter(RecordingRouter):
    """Records the most requests it ever had in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most_in_flight = 0

    async def handle(self, request):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().handle(request)
        finally:
            self.in_flight -= 1


def test_streams_over_the_concurrency_limit_wait_or_end_the_connection(pki):
    """QUIC MAX_STREAMS is max_concurrent_streams, raised as streams end: a conforming client's
    third stream waits for a free one; a client that opens it anyway gets STREAM_LIMIT_ERROR
    (RFC 9000 4.6), counted as stream_limit, and other clients are served throughout."""
    handler = CountingRouter()

    async def main():
        async with await _serve(handler, pki, max_concurrent_streams=2) as server:
            polite = await RawH3.open(server.port, pki.router)
            slow = [polite.request("GET", "/slow?s=0.3") for _ in range(3)]
            await polite.until(lambda c: all(c.done(s) for s in slow), timeout=5.0)
            assert [polite.streams[s].status for s in slow] == [204, 204, 204]
            assert handler.most_in_flight == 2
            rude = await RawH3.open(server.port, pki.drafter)
            rude.exceed_stream_limit()
            for _ in range(3):
                rude.request("GET", "/slow?s=0.3")
            closed = await rude.until_closed()
            assert closed.error_code == QuicErrorCode.STREAM_LIMIT_ERROR
            await assert_serves(polite)
            async with asyncio.timeout(5.0):   # the server's side ends after its closing period
                while server.refusals.counts["stream_limit"] == 0:
                    await asyncio.sleep(0.05)
            assert server.refusals.counts["stream_limit"] == 1
            await polite.aclose()

    run(main())


def test_connections_over_the_total_cap_are_refused(pki):
    async def main():
        async with await _serve(RecordingRouter(), pki, max_connections=3,
                                max_connections_per_client=2) as server:
            first = [await RawH3.open(server.port, pki.drafter) for _ in range(2)]
            router = await RawH3.open(server.port, pki.router)   # another identity: fits
            other = await RawH3.open(server.port, pki.router)    # over the total cap
            closed = await other.until_closed()
            assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD
            assert "max_connections=3" in closed.reason_phrase
            for client in [*first, router]:
                await assert_serves(client)
                await client.aclose()
            assert server.refusals.counts["connections"] == 1
            assert server.refusals.counts["client_connections"] == 0
            async with asyncio.timeout(5.0):   # released once their closing periods end
                while server.connections:
                    await asyncio.sleep(0.05)
            again = await RawH3.open(server.port, pki.router)
            await assert_serves(again)
            await again.aclose()

    run(main())
