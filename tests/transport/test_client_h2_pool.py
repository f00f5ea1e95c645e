"""The HTTP/2 client's connections and streams (client_h2.py), against the real server:
a request that times out resets its stream (the server's concurrency slot comes back: the
leak of httpcore 1.0.x cannot happen), requests beyond the server's stream limit wait or
take another connection, an oversized answer fails alone, a stream the server refused is
`sent=False`, and an idle connection is not reused past its expiry."""

from __future__ import annotations

import asyncio

import cbor2
import pytest
from transport_support import PROPOSAL, RecordingRouter, run

from sdcp_fast.transport import Client, RequestTimeout, TransportError, serve
from sdcp_fast.transport.client_h2 import H2Origins


def _url(server, path: str) -> str:
    return f"https://127.0.0.1:{server.port}{path}"


def test_timed_out_requests_give_their_streams_back(pki):
    """Twice the server's stream limit of requests time out, one after another; each reset
    its stream, so the next request is answered at once (with httpcore it failed: "Max
    outbound streams is 2, 2 open")."""

    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http3=False,
                               max_concurrent_streams=2) as server:
            async with Client(pki.drafter, "h2", timeout=5.0, retries=0) as client:
                for _ in range(4):
                    with pytest.raises(RequestTimeout) as timed_out:
                        await client.request("GET", _url(server, "/slow?s=5"), timeout=0.1)
                    assert timed_out.value.sent
                answer = await client.request("POST", _url(server, "/proposals"), PROPOSAL, timeout=2.0)
                assert answer.status == 200
                assert cbor2.loads(answer.body)["caller"] == "https://drafter-1.example:9001/"
                pool = client._origins._pools[("127.0.0.1", server.port)]
                assert len(pool) == 1 and not pool[0].busy   # one connection, every stream closed

    run(main())


def test_requests_over_the_stream_limit_are_all_answered(pki):
    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http3=False,
                               max_concurrent_streams=2) as server:
            async with Client(pki.drafter, "h2", timeout=5.0, retries=0) as client:
                answers = await asyncio.gather(*(client.request("GET", _url(server, "/slow?s=0.2"))
                                                 for _ in range(7)))
                assert [a.status for a in answers] == [204] * 7
                pool = client._origins._pools[("127.0.0.1", server.port)]
                assert 1 <= len(pool) <= 4   # 2 streams each: more connections, or a wait for a slot

    run(main())


def test_an_oversized_answer_fails_alone(pki):
    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http3=False) as server:
            async with Client(pki.drafter, "h2", timeout=5.0, retries=0, max_response=16) as client:
                with pytest.raises(TransportError, match="over 16 bytes") as refused:
                    await client.request("POST", _url(server, "/proposals"), PROPOSAL)
                assert refused.value.sent
                answer = await client.request("GET", _url(server, "/sessions/abc/output?from=3"))
                assert answer.status == 200 and cbor2.loads(answer.body) == {"id": "abc", "from": 3}

    run(main())


def test_a_closing_server_refuses_unprocessed(pki):
    """A server that is stopping refuses new streams (REFUSED_STREAM) or has closed: either
    way the request was not processed, and the client says so (sent=False: safe to retry)."""

    async def main():
        handler = RecordingRouter()
        server = await serve(handler, host="127.0.0.1", port=0, tls=pki.server, http3=False)
        async with Client(pki.drafter, "h2", timeout=5.0, retries=0) as client:
            slow = asyncio.ensure_future(client.request("GET", _url(server, "/slow?s=0.5")))
            await asyncio.sleep(0.1)
            stopping = asyncio.ensure_future(server.stop())
            await asyncio.sleep(0.1)
            calls = len(handler.calls)
            with pytest.raises(TransportError) as refused:
                await client.request("POST", _url(server, "/proposals"), PROPOSAL)
            assert not refused.value.sent and len(handler.calls) == calls
            assert (await slow).status == 204   # the stream in flight was still answered
            await stopping

    run(main())


def test_an_idle_connection_is_not_reused_past_its_expiry(pki):
    async def main():
        async with await serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, http3=False) as server:
            origins = H2Origins(pki.drafter, connect_timeout=5.0, idle_timeout=0.2,
                                max_response=1 << 20)
            try:
                first, _, _ = await origins.open(_url(server, "/proposals"))
                assert (await first.request("GET", "x", "/sessions/a/output", None, None)).status == 200
                again, _, _ = await origins.open(_url(server, "/proposals"))
                assert again is first
                await asyncio.sleep(0.25)   # past 0.9 x idle_timeout
                fresh, _, _ = await origins.open(_url(server, "/proposals"))
                assert fresh is not first and not first.usable
            finally:
                await origins.aclose()

    run(main())


@pytest.mark.parametrize("url", ["https://127.0.0.1:8443/sessions/a-b/output?from=12", "https://h/", "https://h",
                                 "https://u@h:1/p?q=1", "https://[::1]:9/x", "https://h?x", "https://h:1/a#f",
                                 "https://h:1/p?"])
def test_an_https_url_splits_into_origin_authority_and_path(url):
    from urllib.parse import urlsplit

    from sdcp_fast.transport.client_base import split_https_url
    parts = urlsplit(url)
    assert split_https_url(url) == ((parts.hostname, parts.port or 443), parts.netloc.rpartition("@")[2],
                                    (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
    assert split_https_url(url) == split_https_url(url)   # again, its origin cached


@pytest.mark.parametrize("url", ["http://h/x", "https:///x", "ftp://h/", "https://h:x/p"])
def test_a_url_that_is_not_https_is_refused(url):
    from sdcp_fast.transport.client_base import split_https_url
    with pytest.raises(ValueError):
        split_https_url(url)
