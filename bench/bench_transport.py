"""Transport benchmark: proposal-sized POSTs over HTTP/2 and HTTP/3 with mutual TLS 1.3.

The server runs in its own process (as a verifier would); the client is the transport's
`Client` on one connection, first one request at a time, then 32 concurrent streams.
Prints requests/s and p50/p99 latency per protocol, measured side by side in one run.

    .venv/bin/python bench/bench_transport.py [--requests 2000] [--concurrency 32]
    .venv/bin/python bench/bench_transport.py --libraries [--rounds 5000]

`--libraries`: the HTTP/2 libraries alone, each installed one of ngh2 (the transport's), h2
and jh2 as a sans-IO pair in this process (no sockets, no TLS): µs per round (a
proposal-shaped request and its answer, both ends); for h2 and jh2, the client validating the
answer's fields and not (libnghttp2 always checks them).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

import cbor2

from sdcp_fast.transport import Client, Response, TLSConfig, make_certs, serve

SERVER_URI = "https://127.0.0.1:1/"
DRAFTER_URI = "https://drafter-1.example/"
# ~300 bytes, shaped like a proposal (32-byte digest, 8 tokens, status map)
PROPOSAL = cbor2.dumps({
    "session": bytes(range(16)), "epoch": 1, "round": 17, "drafter": DRAFTER_URI, "base": 412,
    "base_digest": bytes(32), "tokens": [31337, 4242, 17, 99, 1024, 8, 77, 5123],
    "q_rows": "mlc://store/objects/0123456789abcdef0123456789abcdef/round-17/q",
    "status": {"instance": DRAFTER_URI, "role": 1, "load": 37, "queue": 2, "accept_milli": 713,
               "ttl_ms": 2000},
})
VERDICT = cbor2.dumps({"session": bytes(range(16)), "epoch": 1, "round": 17, "accepted": 5,
                       "emitted": [31337, 4242, 17, 99, 1024, 6], "committed": 418,
                       "digest": bytes(32), "action": 0, "m_cap": 8, "low": 0, "load": 40})


class VerdictHandler:
    async def handle(self, request) -> Response:
        return Response(200, VERDICT)


def _server_main(cert_dir: str, ready, stop) -> None:
    async def main():
        tls = TLSConfig.for_instance(cert_dir, SERVER_URI)
        server = await serve(VerdictHandler(), host="127.0.0.1", port=0, tls=tls)
        ready.send(server.port)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(grace=1.0)

    asyncio.run(main())


async def _measure(client: Client, url: str, requests: int, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = [requests]

    async def worker():
        while remaining[0] > 0:
            remaining[0] -= 1
            start = time.perf_counter()
            response = await client.request("POST", url, PROPOSAL, idempotent=True)
            latencies.append(time.perf_counter() - start)
            assert response.status == 200 and response.body == VERDICT

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - started), latencies


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


async def _run(port: int, cert_dir: str, requests: int, concurrency: int) -> list[tuple]:
    rows = []
    url = f"https://127.0.0.1:{port}/proposals"
    tls = TLSConfig.for_instance(cert_dir, DRAFTER_URI)
    for protocol in ("h2", "h3"):
        async with Client(tls, protocol, timeout=10.0) as client:
            await _measure(client, url, 200, 8)  # warm-up: connection, caches
            for streams in (1, concurrency):
                rate, latencies = await _measure(client, url, requests, streams)
                rows.append((protocol, streams, rate, _pct(latencies, 50), _pct(latencies, 99)))
    return rows


REQUEST_HEADERS = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"127.0.0.1:4433"),
                   (b":path", b"/v1/sessions/0123456789abcdef/proposals"),
                   (b"content-type", b"application/sdcp+cbor")]
ANSWER_HEADERS = [(b":status", b"200"), (b"content-type", b"application/sdcp+cbor")]


def _handshake(client, server) -> None:
    """Prefaces and SETTINGS exchanged between two sans-IO connections (h2, jh2 or ngh2)."""
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())


def _us_per_round(one_round, rounds: int) -> float:
    for _ in range(500):
        one_round()
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    return (time.perf_counter() - start) / rounds * 1e6


def _pair_round_us(library: str, rounds: int, validate_answers: bool) -> float:
    """µs per request-and-answer between two connections of `library` (h2 or jh2)."""
    import importlib

    config, connection = (importlib.import_module(f"{library}.{m}") for m in ("config", "connection"))
    events = importlib.import_module(f"{library}.events")
    quiet = dict(header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False)
    client = connection.H2Connection(config.H2Configuration(
        client_side=True, validate_inbound_headers=validate_answers, normalize_inbound_headers=validate_answers,
        **quiet))
    server = connection.H2Connection(config.H2Configuration(
        client_side=False, validate_inbound_headers=False, normalize_inbound_headers=False, **quiet))
    client.initiate_connection()
    server.initiate_connection()
    _handshake(client, server)

    def one_round() -> None:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST_HEADERS)
        client.send_data(stream_id, PROPOSAL, end_stream=True)
        for event in server.receive_data(client.data_to_send()):
            if isinstance(event, events.DataReceived):
                server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        server.send_headers(stream_id, ANSWER_HEADERS)
        server.send_data(stream_id, VERDICT, end_stream=True)
        for event in client.receive_data(server.data_to_send()):
            if isinstance(event, events.DataReceived):
                client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        server.receive_data(client.data_to_send())

    return _us_per_round(one_round, rounds)


def _ngh2_round_us(rounds: int) -> float:
    """µs per request-and-answer between two ngh2 connections, configured as the transport's."""
    import ngh2

    client, server = ngh2.Connection(ngh2.Role.CLIENT), ngh2.Connection(ngh2.Role.SERVER)
    client.initiate_connection({ngh2.Setting.ENABLE_PUSH: 0})
    server.initiate_connection({ngh2.Setting.MAX_HEADER_LIST_SIZE: 16384, ngh2.Setting.ENABLE_PUSH: 0})
    _handshake(client, server)

    def one_round() -> None:
        stream_id = client.send_request(REQUEST_HEADERS)
        client.send_data(stream_id, PROPOSAL, end_stream=True)
        server.receive_data(client.data_to_send())
        server.events()
        server.send_response(stream_id, ANSWER_HEADERS)
        server.send_data(stream_id, VERDICT, end_stream=True)
        client.receive_data(server.data_to_send())
        client.events()
        server.receive_data(client.data_to_send())
        server.events()

    return _us_per_round(one_round, rounds)


def _libraries(rounds: int) -> None:
    import importlib.metadata

    print(f"{'library':24} {'answers validated':>18} {'us per round':>13}")
    print(f"{'ngh2 ' + importlib.metadata.version('ngh2'):24} {'True':>18} {_ngh2_round_us(rounds):13.1f}")
    for library in ("h2", "jh2"):
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            continue
        for validate in (True, False):
            print(f"{library + ' ' + version:24} {str(validate):>18} {_pair_round_us(library, rounds, validate):13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--libraries", action="store_true", help="the HTTP/2 libraries alone (sans-IO)")
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args()
    if args.libraries:
        _libraries(args.rounds)
        return
    cert_dir = tempfile.mkdtemp(prefix="sdcp-bench-certs-")
    make_certs(cert_dir, [SERVER_URI, DRAFTER_URI])
    context = mp.get_context("spawn")
    ready_recv, ready_send = context.Pipe(duplex=False)
    stop = context.Event()
    process = context.Process(target=_server_main, args=(cert_dir, ready_send, stop), daemon=True)
    process.start()
    try:
        if not ready_recv.poll(30):
            raise SystemExit("server did not start")
        port = ready_recv.recv()
        rows = asyncio.run(asyncio.wait_for(_run(port, cert_dir, args.requests, args.concurrency), 600))
    finally:
        stop.set()
        process.join(10)
        if process.is_alive():
            process.terminate()
    print(f"proposal POST: {len(PROPOSAL)} B request, {len(VERDICT)} B response, "
          f"{args.requests} requests per row, one connection, mTLS 1.3")
    print(f"{'protocol':8} {'streams':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for protocol, streams, rate, p50, p99 in rows:
        print(f"{protocol:8} {streams:7d} {rate:8.0f} {p50:8.2f} {p99:8.2f}")
    by = {(p, s): r for p, s, r, _, _ in rows}
    print(f"h3/h2 throughput: 1 stream {by['h3', 1] / by['h2', 1]:.2f}x, "
          f"{args.concurrency} streams {by['h3', args.concurrency] / by['h2', args.concurrency]:.2f}x")


if __name__ == "__main__":
    main()
