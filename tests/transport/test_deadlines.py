"""Whole-request deadlines: a stalled upload gets 408 and frees its stream; a trickling
server cannot hold a client request past its timeout."""

from __future__ import annotations

import asyncio
import json
import ssl

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpx
import pytest
from transport_support import (
    PROPOSAL,
    RecordingRouter,
    files,
    h3_raw_post,
    quic_client_configuration,
    run,
    ssl_client_context,
)

from sdcp_fast.transport import Client, RequestTimeout, serve

BODY_TIMEOUT = 0.3


def _stalled_headers(declared: int) -> list[tuple[str, str]]:
    return [("content-type", "application/sdcp+cbor"), ("content-length", str(declared))]


async def _h2_stalled_upload(port: int, context: ssl.SSLContext) -> tuple[int, dict, bool]:
    """Send a POST's headers (declaring a body) and never the body, over raw h2.

    Returns (status, problem document, stream reset by the server) once the server answers.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "https"),
                          (":authority", f"127.0.0.1:{port}"), (":path", "/proposals"),
                          *_stalled_headers(len(PROPOSAL))])
    writer.write(conn.data_to_send())
    status, body, reset, ended = 0, b"", False, False
    try:
        while not (ended and reset):
            data = await reader.read(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
                elif isinstance(event, h2.events.StreamReset):
                    reset = True
            writer.write(conn.data_to_send())
    finally:
        writer.close()
    return status, json.loads(body), reset


def _assert_408(status: int, problem: dict) -> None:
    assert status == 408
    assert problem == {"type": "about:blank", "title": "Request Timeout", "status": 408,
                       "detail": f"request body not received within {BODY_TIMEOUT:g}s"}


def test_h2_stalled_upload_is_answered_408_and_reset(pki):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, http3=False,
                               body_timeout=BODY_TIMEOUT) as server:
            context = ssl_client_context(pki.server.ca, *files(pki.drafter))
            status, problem, reset = await asyncio.wait_for(
                _h2_stalled_upload(server.port, context), 10.0)
            stalled = [c for conn in server.connections for c in conn._pending]
            async with Client(pki.drafter, "h2") as client:  # the server still serves
                good = await client.request("POST", f"https://127.0.0.1:{server.port}/proposals",
                                            PROPOSAL)
            return status, problem, reset, stalled, good.status

    status, problem, reset, stalled, good = run(main())
    _assert_408(status, problem)
    assert reset and stalled == [] and good == 200
    assert handler.calls[-1].body == PROPOSAL and len(handler.calls) == 1


def test_h3_stalled_upload_is_answered_408(pki):
    handler = RecordingRouter()

    async def main():
        async with await serve(handler, host="127.0.0.1", port=0, tls=pki.server, http2=False,
                               body_timeout=BODY_TIMEOUT) as server:
            configuration = quic_client_configuration(pki.server.ca, *files(pki.drafter))
            headers = [(n.encode(), v.encode()) for n, v in _stalled_headers(len(PROPOSAL))]
            response = await h3_raw_post(server.port, configuration, "/proposals", headers, [])
            stalled = [c for conn in server.connections for c in conn._pending]
            return response, stalled

    response, stalled = run(main())
    _assert_408(response.status, json.loads(response.body))
    assert stalled == [] and handler.calls == []


def test_body_timeout_must_be_positive(pki):
    with pytest.raises(ValueError):
        run(serve(RecordingRouter(), host="127.0.0.1", port=0, tls=pki.server, body_timeout=0))


TRICKLE_BYTES = 60
TRICKLE_GAP_S = 0.05  # one body byte this often: every read is quick, the whole is not


async def _trickling_h2_server(context: ssl.SSLContext):
    """An h2 server that answers every request 200 with a body sent one byte at a time."""
    tasks: set[asyncio.Task] = set()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())

        async def trickle(stream_id: int) -> None:
            conn.send_headers(stream_id, [(":status", "200"),
                                          ("content-length", str(TRICKLE_BYTES))])
            for i in range(TRICKLE_BYTES):
                await asyncio.sleep(TRICKLE_GAP_S)
                conn.send_data(stream_id, b"x", end_stream=i == TRICKLE_BYTES - 1)
                writer.write(conn.data_to_send())

        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        task = asyncio.create_task(trickle(event.stream_id))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                writer.write(conn.data_to_send())
        except (ConnectionError, h2.exceptions.ProtocolError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0, ssl=context)
    return server, tasks


def test_client_timeout_bounds_the_whole_response(pki):
    async def main():
        server, tasks = await _trickling_h2_server(pki.server.server_ssl_context())
        port = server.sockets[0].getsockname()[1]
        try:
            # Each read arrives well within 0.5 s; the whole body takes 3 s.
            async with Client(pki.drafter, "h2", timeout=0.5, retries=0) as client:
                with pytest.raises(RequestTimeout) as timed_out:
                    await client.request("GET", f"https://127.0.0.1:{port}/output")
            return timed_out.value
        finally:
            for task in tasks:
                task.cancel()
            server.close()

    error = run(main())
    assert error.sent and "within 0.5s" in str(error)


def test_trickling_server_really_trickles(pki):
    """The server above is a fair test: httpx with only its own timeouts reads it to the end."""

    async def main():
        server, _ = await _trickling_h2_server(pki.server.server_ssl_context())
        port = server.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(http1=False, http2=True, timeout=0.5, trust_env=False,
                                         verify=pki.drafter.client_ssl_context()) as client:
                response = await client.get(f"https://127.0.0.1:{port}/output")
            return response.status_code, response.content
        finally:
            server.close()

    assert run(main()) == (200, b"x" * TRICKLE_BYTES)
