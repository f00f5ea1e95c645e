"""The HTTP/2 server takes a request whose headers and ending data arrive in one read in one
step (H2ServerProtocol._on_whole_request); what it sends and what it books must be what it
made of the three events (RequestReceived, DataReceived, StreamEnded) taken one by one:
answered, refused from the headers (415, 431), malformed, over the body limit, and refused
while the connection closes. The protocol on a stand-in transport (no sockets), its client
an h2 connection."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import h2.config
import h2.connection
import h2.events
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from transport_h2pair import received
from transport_support import pki  # noqa: F401 (fixture)

from sdcp_fast.transport.http import Request, Response, Routed, Router
from sdcp_fast.transport.limits import Limits
from sdcp_fast.transport.server_h2 import H2ServerProtocol
from sdcp_fast.transport.serving import Serving


class EventByEvent(H2ServerProtocol):
    """The protocol taking a whole request's three events one by one, as before."""

    def _on_whole_request(self, request, data):
        for event in (request, data, data.stream_ended):
            if self._transport is None or self._transport.is_closing():
                return
            self._on_event(event)


class Service(Routed):   # the server awaits its router's start (http.handler_entry)
    def __init__(self, router: Router):
        self.router = router


class Transport(asyncio.Transport):
    def __init__(self, der: bytes):
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self._ssl = SimpleNamespace(selected_alpn_protocol=lambda: "h2", version=lambda: "TLSv1.3",
                                    getpeercert=lambda binary_form: der)

    def get_extra_info(self, name, default=None):
        return self._ssl if name == "ssl_object" else default

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


POST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v"), (b":path", b"/echo"),
        (b"content-type", b"application/sdcp+cbor")]
REQUESTS = {
    "answered": [(POST, b"abc")],
    "an empty body": [(POST, b"")],
    "over the body limit": [(POST, b"x" * 101), (POST, b"after")],
    "refused from its headers (415)": [([*POST[:4], (b"content-type", b"text/plain")], b"abc"), (POST, b"ok")],
    "too many header bytes (431)": [([*POST, (b"x-big", b"v" * 3000)], b"abc"), (POST, b"ok")],
    "malformed": [([*POST, (b"Upper", b"x")], b"abc"), (POST, b"ok")],
    "a path without a route": [([*POST[:3], (b":path", b"/nowhere"), POST[4]], b"abc")],
}


async def _run(cls, serving: Serving, der: bytes, requests, *, closing_first: bool) -> tuple:
    transport = Transport(der)
    protocol = cls(serving, ("127.0.0.1", 1))
    protocol.start(transport)
    client = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False))
    client.initiate_connection()
    events: list = []

    def exchange() -> None:
        protocol.data_received(client.data_to_send())
        out, transport.written[:] = b"".join(transport.written), []
        events.extend(client.receive_data(out))

    exchange()
    if closing_first:   # a request in flight, then a graceful close: new requests are refused
        client.send_headers(1, [*POST[:3], (b":path", b"/hold"), POST[4]], end_stream=True)
        exchange()
        protocol.goaway()
    for headers, body in requests:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, headers)
        client.send_data(stream_id, body, end_stream=True)
        exchange()   # headers and data in one read
        for _ in range(5):   # the answer's task, and the flush after it
            await asyncio.sleep(0)
        exchange()
    conn = protocol._conn
    manager = conn._inbound_flow_control_window_manager   # the bytes acknowledged, not yet given back
    books = (conn.inbound_flow_control_window, manager._bytes_processed, conn.outbound_flow_control_window,
             conn.highest_inbound_stream_id,
             {sid: s.state_machine.state for sid, s in conn.streams.items()}, dict(conn._closed_streams))
    state = (sorted(protocol._tasks), len(protocol._pending), dict(protocol._discarding), transport.closing,
             {name: strikes.count for name, strikes in vars(protocol._strikes).items() if hasattr(strikes, "count")})
    for task in list(protocol._tasks.values()):
        task.cancel()
    return received(events), [type(e).__name__ for e in events], books, state, dict(serving.refusals.counts)


@pytest.mark.parametrize("closing_first", [False, True])
@pytest.mark.parametrize("name", list(REQUESTS))
def test_a_whole_request_is_taken_as_its_three_events(pki, name, closing_first):  # noqa: F811
    der = x509.load_pem_x509_certificate(pki.drafter.cert.read_bytes()).public_bytes(Encoding.DER)
    hold = asyncio.Event()

    async def echo(request: Request) -> Response:
        return Response(200, request.body + request.caller.encode())

    async def held(request: Request) -> Response:
        await hold.wait()
        return Response(204, content_type=None)

    async def main():
        seen = []
        for cls in (H2ServerProtocol, EventByEvent):
            router = Router()
            router.add("POST", "/echo", echo)
            router.add("POST", "/hold", held)
            serving = Serving(Service(router), tls=pki.server, limits=Limits(max_body=100, max_header_list=2048))
            seen.append(await _run(cls, serving, der, REQUESTS[name], closing_first=closing_first))
        return seen

    whole, by_events = asyncio.run(main())
    assert whole == by_events
    assert whole[1]   # the client heard something
