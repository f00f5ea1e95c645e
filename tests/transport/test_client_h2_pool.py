"""The HTTP/2 client replaces a pool whose stream accounting drifted (client_h2.py: httpcore
1.0.x leaks one of the server's concurrent streams per request that times out before its
END_STREAM went out). The drift itself is timing-dependent, so httpx's mock transport raises
the two errors it ends in; the real pool's behaviour against a live server is bench_soak's."""

from __future__ import annotations

import httpx
import pytest
from transport_support import run

from sdcp_fast.transport.client_base import TransportError
from sdcp_fast.transport.client_h2 import H2Origins

URL = "https://127.0.0.1:1/proposals"


def _origins(pki, answers: list) -> tuple[H2Origins, list[httpx.AsyncClient]]:
    """H2Origins whose clients answer from `answers` in turn: an exception is raised, an int
    is a status. Returns the clients made, in order."""
    origins = H2Origins(pki.drafter, timeout=0.05, connect_timeout=1.0, idle_timeout=60.0, max_response=1 << 20)
    made: list[httpx.AsyncClient] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return httpx.Response(answer, stream=httpx.ByteStream(b"\xa0"))

    def make() -> httpx.AsyncClient:
        made.append(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        return made[-1]

    origins._make = make
    run(origins._httpx.aclose())
    origins._httpx = make()
    return origins, made


@pytest.mark.parametrize("drift", [
    httpx.LocalProtocolError("Max outbound streams is 128, 128 open"),
    ValueError("semaphore released too many times"),
], ids=["max-outbound-streams", "semaphore"])
def test_a_drifted_pool_is_replaced_and_the_next_request_goes_through(pki, drift):
    origins, made = _origins(pki, [200, drift, 200, 200])

    async def main():
        assert (await origins.send(URL, "POST", b"\xa0", "application/sdcp+cbor", 1.0)).status == 200
        with pytest.raises(TransportError) as refused:
            await origins.send(URL, "POST", b"\xa0", "application/sdcp+cbor", 1.0)
        # not sent: the stream was never opened (h2 refused it); unknown: the slot's release failed
        assert refused.value.sent is isinstance(drift, ValueError)
        assert len(made) == 2 and origins._httpx is made[1]
        for _ in range(2):
            assert (await origins.send(URL, "POST", b"\xa0", "application/sdcp+cbor", 1.0)).status == 200
        assert len(made) == 2                 # one replacement per drift
        await origins.aclose()
        assert made[0].is_closed and made[1].is_closed

    run(main())


def test_other_errors_keep_the_pool(pki):
    origins, made = _origins(pki, [httpx.ReadError("connection reset"), 200])

    async def main():
        with pytest.raises(TransportError):
            await origins.send(URL, "POST", b"\xa0", "application/sdcp+cbor", 1.0)
        assert (await origins.send(URL, "POST", b"\xa0", "application/sdcp+cbor", 1.0)).status == 200
        assert len(made) == 1
        await origins.aclose()

    run(main())
