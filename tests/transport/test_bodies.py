"""Bad input gets the right 4xx with a problem document, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import cbor2
import httpx
import pytest
from transport_support import (
    DRAFTER_URI,
    PROPOSAL,
    PROTOCOLS,
    RecordingRouter,
    files,
    h3_raw_post,
    quic_client_configuration,
    run,
    ssl_client_context,
    wait_for_log,
)

from sdcp_fast.transport import Client, RequestTimeout, TransportError, serve

MAX_BODY = 4096


def _problem(response) -> dict:
    assert response.content_type == "application/problem+json"
    return json.loads(response.body)


async def _expect_good(client, port) -> None:
    """The check that follows every refusal: the same client, same connection, a good request."""
    response = await client.request("POST", f"https://127.0.0.1:{port}/proposals", PROPOSAL)
    assert response.status == 200
    assert cbor2.loads(response.body)["caller"] == DRAFTER_URI


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("body", "content_type", "status", "suffix", "detail_part"),
    [
        (b"\xa1\x01", "application/sdcp+cbor", 400, "bad-request", "malformed CBOR"),  # truncated map
        (b"\x1c", "application/sdcp+cbor", 400, "bad-request", "malformed CBOR"),  # reserved info 28
        (b"\x83\x01\x02\x03", "application/sdcp+cbor", 400, "bad-request", "must be a map"),
        (PROPOSAL, "application/cbor", 415, "unsupported-media-type", "application/cbor"),
        (PROPOSAL, "application/json; charset=utf-8", 415, "unsupported-media-type", "application/json"),
        (PROPOSAL, None, 415, "unsupported-media-type", "no content-type"),
        (b"\x00" * (MAX_BODY + 1), "application/sdcp+cbor", 413, "too-large", f"limit of {MAX_BODY}"),
        (b"\x00" * 300_000, "application/sdcp+cbor", 413, "too-large", f"limit of {MAX_BODY}"),
    ],
    ids=["truncated", "reserved", "not-a-map", "cbor", "json", "none", "limit+1", "300k"],
)
def test_bad_body_answers_problem_and_server_keeps_serving(pki, protocol, body, content_type, status,
                                                          suffix, detail_part):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, max_body=MAX_BODY) as server:
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                response = await client.request("POST", url, body, content_type=content_type)
                assert response.status == status
                document = _problem(response)
                assert document["status"] == status
                assert document["type"].endswith(":" + suffix)
                assert detail_part in document["detail"]
                assert response.problem().status == status
                await _expect_good(client, server.port)

    run(main())
    # 413/415 are decided by the transport: the handler saw only the good request
    expected_calls = 2 if status == 400 else 1
    assert len(handler.calls) == expected_calls


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_oversize_body_arriving_whole_with_its_headers_is_refused(pki, protocol):
    """A body past the limit in the same packet as its headers (no content-length: short
    bodies announce none): 413, the handler never sees it, the connection keeps serving."""
    handler = RecordingRouter()
    limit = 256

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, max_body=limit) as server:
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                response = await client.request("POST", url, b"\x00" * (limit + 200),
                                                content_type="application/sdcp+cbor")
                assert response.status == 413
                assert _problem(response)["detail"] == f"body exceeds the limit of {limit} bytes"
                await _expect_good(client, server.port)

    run(main())
    assert len(handler.calls) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_oversize_body_without_content_length_is_cut_off(pki, protocol):
    """No declared length: 413 as soon as the received bytes pass the limit."""
    handler = RecordingRouter()
    chunks = [b"\x00" * 1024] * 8  # 8 KiB > 4 KiB limit

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, max_body=MAX_BODY) as server:
            if protocol == "h2":
                async def stream():
                    for chunk in chunks:
                        yield chunk

                async with httpx.AsyncClient(http1=False, http2=True, timeout=5.0, trust_env=False,
                                             verify=ssl_client_context(str(pki.server.ca), *files(pki.drafter))) as raw:
                    response = await raw.post(f"https://127.0.0.1:{server.port}/proposals", content=stream(),
                                              headers={"content-type": "application/sdcp+cbor"})
                    assert "content-length" not in response.request.headers
                    status, document = response.status_code, response.json()
            else:
                response = await h3_raw_post(
                    server.port, quic_client_configuration(str(pki.server.ca), *files(pki.drafter)),
                    "/proposals", [(b"content-type", b"application/sdcp+cbor")], chunks)
                status, document = response.status, json.loads(response.body)
            assert status == 413
            assert document["detail"] == f"body exceeds the limit of {MAX_BODY} bytes"
            async with Client(pki.drafter, protocol, timeout=5.0) as client:
                await _expect_good(client, server.port)

    run(main())
    assert len(handler.calls) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_resources_404_405_500_and_query(pki, protocol):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server) as server:
            base = f"https://127.0.0.1:{server.port}"
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                missing = await client.request("GET", base + "/nowhere")
                assert (missing.status, _problem(missing)["type"].rsplit(":", 1)[1]) == (404, "not-found")
                wrong = await client.request("DELETE", base + "/proposals")
                assert wrong.status == 405
                assert wrong.headers["allow"] == "POST"
                assert _problem(wrong)["type"].endswith(":method-not-allowed")
                wrong_get = await client.request("GET", base + "/proposals")
                assert (wrong_get.status, wrong_get.headers["allow"]) == (405, "POST")
                bug = await client.request("GET", base + "/boom")
                assert bug.status == 500 and _problem(bug)["status"] == 500
                output = await client.request("GET", base + "/sessions/AAECAwQFBgcICQoLDA0ODw/output?from=7")
                assert output.status == 200
                assert cbor2.loads(output.body) == {"id": "AAECAwQFBgcICQoLDA0ODw", "from": 7}
                await _expect_good(client, server.port)

    run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_32_concurrent_streams_on_one_connection(pki, protocol):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server) as server:
            async with Client(pki.drafter, protocol, timeout=5.0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                bodies = [cbor2.dumps({"round": i, "pad": b"x" * 250}) for i in range(32)]
                responses = await asyncio.gather(*(client.request("POST", url, b) for b in bodies))
                assert [cbor2.loads(r.body)["echo"]["round"] for r in responses] == list(range(32))
                assert len(server.connections) == 1  # all 32 streams shared one connection

    run(main())
    assert len(handler.calls) == 32
    assert {c.caller for c in handler.calls} == {DRAFTER_URI}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_timeouts_client_and_handler(pki, protocol):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server,
                               handler_timeout=0.5) as server:
            base = f"https://127.0.0.1:{server.port}"
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                with pytest.raises(RequestTimeout):
                    await client.request("GET", base + "/slow?s=0.4", timeout=0.1)
                slow = await client.request("GET", base + "/slow?s=3")  # server gives up at 0.5 s
                assert slow.status == 503 and _problem(slow)["type"].endswith(":unavailable")
                await _expect_good(client, server.port)

    run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_handler_time_limit_per_request_among_concurrent_ones(pki, protocol):
    """Each overdue handler is answered 503 at its own limit; requests answered in time
    on the same connection, before and after, are not touched."""
    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server,
                               handler_timeout=0.4) as server:
            base = f"https://127.0.0.1:{server.port}"
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                async def later(delay, seconds):
                    await asyncio.sleep(delay)
                    started = asyncio.get_running_loop().time()
                    response = await client.request("GET", f"{base}/slow?s={seconds}")
                    return response.status, asyncio.get_running_loop().time() - started

                answers = await asyncio.gather(later(0, 2), later(0.15, 2), later(0.05, 0.05),
                                               later(0.3, 0.1), later(0.6, 2))
                assert [status for status, _ in answers] == [503, 503, 204, 204, 503]
                for status, took in answers:
                    if status == 503:
                        assert 0.35 <= took < 1.5   # at its own limit, not another's
                await _expect_good(client, server.port)

    run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_retries_only_when_safe(pki, protocol):
    """The first call drops the connection mid-request: retried only for idempotent requests."""

    class DropFirst(RecordingRouter):
        server = None

        async def handle(self, request):
            self.calls.append(request)
            if len(self.calls) in (1, 3):  # drop the 1st and 3rd request's connection
                for connection in list(self.server.connections):
                    connection.abort()
                await asyncio.sleep(1)
            return await self.router.handle(request)

    handler = DropFirst()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server) as server:
            handler.server = server
            url = f"https://127.0.0.1:{server.port}/proposals"
            async with Client(pki.drafter, protocol, timeout=3.0, retries=2) as client:
                ok = await client.request("POST", url, PROPOSAL, idempotent=True)  # calls 1 (dropped), 2
                assert ok.status == 200
                with pytest.raises(TransportError) as info:
                    await client.request("POST", url, PROPOSAL)  # call 3, dropped: not retried
                assert info.value.sent is True
                await _expect_good(client, server.port)  # call 4 on a new connection

    run(main())
    assert len(handler.calls) == 4


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unreachable_server_is_a_transport_error(pki, protocol):
    async def main():
        server = await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server)
        port = server.port
        await server.stop()
        async with Client(pki.drafter, protocol, timeout=1.0, connect_timeout=0.5, retries=1) as client:
            with pytest.raises(TransportError) as info:
                await client.request("POST", f"https://127.0.0.1:{port}/proposals", PROPOSAL)
            assert info.value.sent is False

    run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stop_lets_requests_in_flight_finish(pki, protocol, transport_logs):
    """Stopping: new streams are refused as unprocessed (safe to retry), in-flight ones answered."""
    handler = RecordingRouter()

    async def main():
        server = await serve(handler, host="127.0.0.1", port=0, tls=pki.server)
        url = f"https://127.0.0.1:{server.port}/proposals"
        async with Client(pki.drafter, protocol, timeout=5.0, connect_timeout=0.5, retries=0) as client:
            await _expect_good(client, server.port)  # the connection exists before stop begins
            in_flight = asyncio.create_task(
                client.request("GET", f"https://127.0.0.1:{server.port}/slow?s=0.5"))
            while len(handler.calls) < 2:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(server.stop(grace=3.0))
            await asyncio.sleep(0.05)
            with pytest.raises(TransportError) as refused:
                await client.request("POST", url, PROPOSAL)
            assert refused.value.sent is False  # REFUSED_STREAM / H3_REQUEST_REJECTED
            assert (await in_flight).status == 204
            await stopping
            with pytest.raises(TransportError):
                await client.request("POST", url, PROPOSAL)
        await wait_for_log(transport_logs, "stopped serving")

    run(main())
    assert [c.path for c in handler.calls] == ["/proposals", "/slow"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_idle_connections_close_and_clients_reconnect(pki, protocol, transport_logs):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server,
                               idle_timeout=0.3) as server:
            async with Client(pki.drafter, protocol, timeout=5.0) as client:
                await _expect_good(client, server.port)
                await asyncio.sleep(0.2)
                await _expect_good(client, server.port)  # activity postpones the idle close
                assert len(server.connections) == 1
                await wait_for_log(transport_logs, "refused idle")
                # a fresh connection, transparently: httpx may write on the connection the
                # server just closed and then sees only a read error, which an idempotent
                # request (proposals are) retries on a new one
                response = await client.request("POST", f"https://127.0.0.1:{server.port}/proposals",
                                                PROPOSAL, idempotent=True)
                assert response.status == 200

    run(main())
    assert len(handler.calls) == 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_garbage_is_dropped_and_server_keeps_serving(pki, protocol, transport_logs):
    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server) as server:
            if protocol == "h2":  # TLS is fine, then HTTP/1.1 instead of the HTTP/2 preface
                context = ssl_client_context(str(pki.server.ca), *files(pki.drafter))
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 5.0) != b""  # GOAWAY, then EOF
                writer.close()
                await wait_for_log(transport_logs, "refused protocol")
            else:  # datagrams that are not QUIC at all, and a truncated Initial
                loop = asyncio.get_running_loop()
                transport, _ = await loop.create_datagram_endpoint(
                    asyncio.DatagramProtocol, remote_addr=("127.0.0.1", server.port))
                for junk in (b"\x00" * 1200, b"\xc0\x00\x00\x00\x01" + b"\xff" * 1195, b"hello"):
                    transport.sendto(junk)
                await asyncio.sleep(0.1)
                transport.close()
            async with Client(pki.drafter, protocol, timeout=5.0) as client:
                await _expect_good(client, server.port)

    run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_client_announces_the_length_of_long_bodies_only(pki, protocol, monkeypatch):
    """Our client sends content-length with a body of ANNOUNCE_LENGTH_FROM bytes or more (a
    server can refuse it before the upload) and none with a shorter one (every SDCP round:
    the frames carry the end of the body); both arrive whole."""
    from sdcp_fast.transport.client_base import ANNOUNCE_LENGTH_FROM
    from sdcp_fast.transport.exchange import IncomingRequest

    seen: list[dict[bytes, bytes]] = []
    original = IncomingRequest.from_headers.__func__

    def recording(cls, headers, **kwargs):
        seen.append(dict(headers))
        return original(cls, headers, **kwargs)

    monkeypatch.setattr(IncomingRequest, "from_headers", classmethod(recording))
    handler = RecordingRouter()
    short, long = PROPOSAL, cbor2.dumps({"pad": bytes(ANNOUNCE_LENGTH_FROM)})

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, max_body=1 << 20) as server:
            async with Client(pki.drafter, protocol, timeout=5.0, retries=0) as client:
                url = f"https://127.0.0.1:{server.port}/proposals"
                for body in (short, long):
                    response = await client.request("POST", url, body)
                    assert response.status == 200, response.body[:200]

    run(main())
    posts = [headers for headers in seen if headers.get(b":method") == b"POST"]
    assert len(posts) == 2
    assert b"content-length" not in posts[0]
    assert posts[1][b"content-length"] == str(len(long)).encode()
    assert [call.body for call in handler.calls] == [short, long]
