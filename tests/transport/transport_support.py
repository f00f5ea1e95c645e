"""Helpers for the transport tests: a PKI, hand-built peers, a recording handler."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cbor2
import httpx
import pytest
from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from sdcp_fast.core.problems import Kind, problem
from sdcp_fast.transport import (
    SDCP_MEDIA_TYPE,
    ClientResponse,
    Request,
    Response,
    Router,
    TLSConfig,
    make_certs,
)
from sdcp_fast.transport.certs import make_ca, make_instance_cert, write_pair
from sdcp_fast.transport.client_h3 import H3ClientConnection

SERVER_URI = "https://127.0.0.1:8443/"
DRAFTER_URI = "https://drafter-1.example:9001/"
ROUTER_URI = "https://router-1.example/"
PROTOCOLS = ["h2", "h3"]
TEST_TIMEOUT = 20.0  # every test coroutine is bounded (pytest-timeout is the outer net)


@dataclass(frozen=True)
class PKI:
    root: Path
    server: TLSConfig
    drafter: TLSConfig
    router: TLSConfig
    foreign: TLSConfig  # right URI, but issued by another CA (its own ca field points at ours)
    expired: TLSConfig  # our CA, validity ended yesterday
    stolen: TLSConfig  # the drafter's certificate with somebody else's private key
    ambiguous: TLSConfig  # our CA, but two URI SANs: names nobody unambiguously


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    paths = make_certs(root, [SERVER_URI, DRAFTER_URI, ROUTER_URI])
    ca_file = paths.ca_cert
    tls = {uri: TLSConfig(p.cert, p.key, ca_file) for uri, p in paths.instances.items()}

    other_ca = make_ca("another CA")
    cert, key = make_instance_cert(other_ca, DRAFTER_URI)
    write_pair(cert, key, root / "foreign.pem", root / "foreign.key")

    from sdcp_fast.transport.certs import load_ca

    ca = load_ca(root)
    now = dt.datetime.now(dt.UTC)
    cert, key = make_instance_cert(ca, DRAFTER_URI, not_before=now - dt.timedelta(days=30),
                                   not_after=now - dt.timedelta(days=1))
    write_pair(cert, key, root / "expired.pem", root / "expired.key")

    _, thief_key = make_instance_cert(ca, "https://thief.example/")
    drafter_cert = x509_load(paths.instances[DRAFTER_URI].cert)
    write_pair(drafter_cert, thief_key, root / "stolen.pem", root / "stolen.key")

    cert, key = _two_uri_cert(ca)
    write_pair(cert, key, root / "ambiguous.pem", root / "ambiguous.key")

    return PKI(
        root, tls[SERVER_URI], tls[DRAFTER_URI], tls[ROUTER_URI],
        TLSConfig(root / "foreign.pem", root / "foreign.key", ca_file),
        TLSConfig(root / "expired.pem", root / "expired.key", ca_file),
        TLSConfig(root / "stolen.pem", root / "stolen.key", ca_file),
        TLSConfig(root / "ambiguous.pem", root / "ambiguous.key", ca_file),
    )


def _two_uri_cert(ca):
    """Like make_instance_cert, with a second URI SAN added."""
    from cryptography.hazmat.primitives import hashes

    template, key = make_instance_cert(ca, DRAFTER_URI)
    san = template.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [*san, x509.UniformResourceIdentifier("https://someone-else.example/")]
    builder = (x509.CertificateBuilder().subject_name(template.subject).issuer_name(template.issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(template.not_valid_before_utc)
               .not_valid_after(template.not_valid_after_utc))
    for extension in template.extensions:
        value = x509.SubjectAlternativeName(names) if isinstance(extension.value, x509.SubjectAlternativeName) \
            else extension.value
        builder = builder.add_extension(value, extension.critical)
    return builder.sign(ca.key, hashes.SHA256()), key


def x509_load(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def run(coro, timeout: float = TEST_TIMEOUT):
    """Run one test coroutine with a hard time limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_for_log(caplog: pytest.LogCaptureFixture, needle: str, timeout: float = 5.0) -> str:
    """The first transport log message containing `needle` (aioquic reports closes after a drain)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        for record in caplog.records:
            if record.name == "sdcp_fast.transport" and needle in record.getMessage():
                return record.getMessage()
        await asyncio.sleep(0.02)
    messages = [r.getMessage() for r in caplog.records if r.name == "sdcp_fast.transport"]
    raise AssertionError(f"no log line with {needle!r}; got {messages}")


@pytest.fixture
def transport_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="sdcp_fast.transport")
    return caplog


PROPOSAL = cbor2.dumps({"session": b"\x01" * 16, "epoch": 1, "round": 1, "tokens": [5, 6, 7]})
CBOR = [(b"content-type", SDCP_MEDIA_TYPE.encode())]


@dataclass
class StreamLog:
    """What a raw client (transport_rawh2.RawH2, transport_rawh3.RawH3) saw of one stream."""

    status: int | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    data_frames: int = 0
    ended: bool = False
    reset: int | None = None  # the error code of the server's stream reset


async def assert_serves(client) -> None:
    """The raw client's connection (RawH2 or RawH3) still answers a proposal with 200."""
    sid = client.request("POST", "/proposals", CBOR, PROPOSAL)
    await client.until(lambda c: c.done(sid))
    assert client.streams[sid].status == 200


def ssl_client_context(ca: str, cert=None, key=None, *, tls12: bool = False) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=ca)
    context.set_alpn_protocols(["h2"])
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


async def h2_post(port: int, context: ssl.SSLContext, body: bytes = PROPOSAL) -> httpx.Response:
    async with httpx.AsyncClient(http1=False, http2=True, verify=context, timeout=5.0,
                                 trust_env=False) as client:
        return await client.post(f"https://127.0.0.1:{port}/proposals", content=body,
                                 headers={"content-type": SDCP_MEDIA_TYPE})


def quic_client_configuration(ca: str, cert_file=None, key_file=None) -> QuicConfiguration:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=["h3"],
                                      verify_mode=ssl.CERT_REQUIRED, idle_timeout=5.0)
    configuration.load_verify_locations(cafile=ca)
    if cert_file is not None:  # set directly: aioquic does not check that key and cert match
        configuration.certificate = x509.load_pem_x509_certificate(open(cert_file, "rb").read())
        configuration.private_key = serialization.load_pem_private_key(open(key_file, "rb").read(), None)
    return configuration


async def h3_post(port: int, configuration: QuicConfiguration, body: bytes = PROPOSAL,
                  tweak_tls: Callable[[tls.Context], None] | None = None) -> ClientResponse:
    """Connect (optionally altering the client's TLS context first) and POST one proposal."""
    loop = asyncio.get_running_loop()
    connection = QuicConnection(configuration=configuration)
    if tweak_tls is not None:
        initialize = connection._initialize

        def _initialize(peer_cid: bytes) -> None:
            initialize(peer_cid)
            tweak_tls(connection.tls)

        connection._initialize = _initialize
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: H3ClientConnection(connection), local_addr=("127.0.0.1", 0))
    protocol._datagram_transport = transport
    try:
        protocol.connect(("127.0.0.1", port))
        await asyncio.wait_for(protocol.wait_connected(), 5.0)
        return await asyncio.wait_for(protocol.request("POST", f"127.0.0.1:{port}", "/proposals", body,
                                                       SDCP_MEDIA_TYPE), 5.0)
    finally:
        protocol.close()


def files(config: TLSConfig) -> tuple[str, str]:
    return str(config.cert), str(config.key)


def decode_map(body: bytes) -> dict:
    """Role-code style: any decoding failure or a non-map top level is a 400 problem."""
    try:
        value = cbor2.loads(body)
    except (cbor2.CBORDecodeError, ValueError, TypeError, EOFError) as exc:
        raise problem(Kind.BAD_REQUEST, f"malformed CBOR: {exc}") from exc
    if not isinstance(value, dict):
        raise problem(Kind.BAD_REQUEST, "top level must be a map")
    return value


class RecordingRouter:
    """Routes: POST /proposals (echo), GET /sessions/{id}/output, GET /boom, GET /slow."""

    def __init__(self) -> None:
        self.calls: list[Request] = []
        self.router = Router()
        self.router.add("POST", "/proposals", self.proposals)
        self.router.add("GET", "/sessions/{id}/output", self.output)
        self.router.add("GET", "/boom", self.boom)
        self.router.add("GET", "/slow", self.slow)

    async def handle(self, request: Request) -> Response:
        self.calls.append(request)
        return await self.router.handle(request)

    async def proposals(self, request: Request) -> Response:
        message = decode_map(request.body)
        return Response(200, cbor2.dumps({"caller": request.caller, "echo": message}))

    async def output(self, request: Request, id: str) -> Response:
        return Response(200, cbor2.dumps({"id": id, "from": int(request.query.get("from", "0"))}))

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("a bug in role code")

    async def slow(self, request: Request) -> Response:
        await asyncio.sleep(float(request.query.get("s", "2")))
        return Response(204, b"", None)


async def h3_raw_post(port: int, configuration: QuicConfiguration, path: str,
                      headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> ClientResponse:
    """POST with exactly these headers (e.g. no content-length) and the body in several DATA frames."""
    from sdcp_fast.transport.client_base import Exchange
    from sdcp_fast.transport.h3 import DATA, frame

    loop = asyncio.get_running_loop()
    connection = QuicConnection(configuration=configuration)
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: H3ClientConnection(connection), local_addr=("127.0.0.1", 0))
    protocol._datagram_transport = transport
    try:
        protocol.connect(("127.0.0.1", port))
        await asyncio.wait_for(protocol.wait_connected(), 5.0)
        stream_id = connection.get_next_available_stream_id()
        exchange = Exchange(loop.create_future(), 1 << 20)
        protocol._exchanges[stream_id] = exchange
        protocol._h3.send(stream_id, [
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", f"127.0.0.1:{port}".encode()),
            (b":path", path.encode()), *headers], end_stream=False)
        protocol.transmit()   # the headers leave now, before the body
        for index, chunk in enumerate(chunks):
            try:
                connection.send_stream_data(stream_id, frame(DATA, chunk) if chunk else b"",
                                            end_stream=index == len(chunks) - 1)
            except (ValueError, RuntimeError):  # the server sent STOP_SENDING: the upload is over
                break
            protocol.transmit()
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(exchange.future, 5.0)
    finally:
        protocol.close()
