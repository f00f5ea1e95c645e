"""HTTP/2 and HTTP/3 with mutual TLS 1.3: the only part of sdcp-fast that touches sockets.
(Plain-HTTP pages for clients and scrapers: `asgi.serve_web`, through hypercorn.)

Server side (role code implements the Handler):

    @dataclass(frozen=True) Request(method: str, path: str, query: dict[str, str],
                                    content_type: str | None, body: bytes, caller: str | None)
    @dataclass(frozen=True) Response(status: int, body: bytes = b"",
                                     content_type: str | None = "application/sdcp+cbor",
                                     headers: tuple[tuple[str, str], ...] = ())
    class Handler(Protocol): async def handle(self, request: Request) -> Response
    problem_response(problem: Problem, headers=()) -> Response       # application/problem+json
    Router(*, prefix="", authorizer=None); .add(method, pattern, fn, *, resource=None)
        # fn: async (request, **path_params) -> Response; 404 / 405 (+ Allow) answered for you
    Router.add_message(method, pattern, fn, *, body=MessageType | None, resource=None)
        # fn: async (call: Call(caller, query), [message,] **path_params) -> message (200
        # CBOR) | None (204) | Response; the body is decoded strictly before fn runs
    Authorizer(rules: Mapping[str, Iterable[str]]); .allows(caller, resource) -> bool;
        .check(caller, resource) raises ProblemError(403 forbidden); "*" = any authenticated caller
    Routed: base of a Handler whose requests all go to `self.router` (the roles' services)
    async serve(handler, *, host: str, port: int, tls: TLSConfig, http3=True, http2=True,
                limits: Limits = Limits(), refusals: Refusals | None = None,
                **limit_overrides) -> Server
    Limits: every limit against hostile clients (limits.py; the config's [transport] table)
    Refusals(on_count=fn): every refusal counted by kind, logged once per client and minute
    Server.port: int; await Server.stop(grace=5.0); also an async context manager

    The caller is the single URI SAN of the client certificate, checked by one certificate
    policy on both protocols (certpolicy.py). The transport answers itself: a malformed
    request with a reset of its stream, 431 (header list over the limit), 413 (body over
    its resource's limit, decided from content-length or as bytes arrive), 415 (POST/PUT
    without application/sdcp+cbor), 400 (bad path or query) and 408 (body not complete
    body_timeout seconds after the headers); a ProblemError raised by the handler becomes
    its problem document; any other exception a logged 500. The servers never decode CBOR;
    `Router.add_message` does, into the message type its route declares.

Client side:

    Client(tls: TLSConfig, protocol: "h2" | "h3" = "h2", *, timeout=10.0, connect_timeout=5.0,
           retries=2, idle_timeout=600.0, max_response=16 MiB)
    await Client.request(method, url, body: bytes | None = None,
                         content_type="application/sdcp+cbor", *, idempotent=False,
                         timeout=None) -> ClientResponse(status, headers, body)
        # raises TransportError(sent=...) / RequestTimeout; retries only when safe;
        # each attempt, connection set-up included, ends within `timeout` seconds
    ClientResponse.problem() -> Problem | None;  await Client.close()
    await call(client, method, url, message=None, AnswerType=None, *, timeout=None)
        -> Reply(status, ok, message, problem, detail)      # typed: roles never see CBOR

Certificates and TLS:

    certs.make_certs(directory, instances: list[str], *, days=365) -> CertPaths
    certs.main(argv) -> int                                  # `sdcp-fast certs --dir DIR URI...`
    TLSConfig(cert: Path, key: Path, ca: Path); TLSConfig.for_instance(directory, uri)
"""

from .calls import Reply, call
from .certs import CertPaths, make_certs
from .client import Client
from .client_base import ClientResponse, RequestTimeout, TransportError
from .compat import H2_CLOSED_STREAMS_KEPT
from .http import (
    ANY_CALLER,
    SDCP_MEDIA_TYPE,
    Authorizer,
    Call,
    Handler,
    Request,
    Response,
    Routed,
    Router,
    message_response,
    problem_response,
)
from .limits import Limits
from .refusals import Refusals
from .server import Server, serve
from .tlsconfig import TLSConfig

__all__ = [
    "ANY_CALLER", "H2_CLOSED_STREAMS_KEPT", "SDCP_MEDIA_TYPE", "Authorizer", "Call", "CertPaths", "Reply", "Client", "ClientResponse",
    "Handler", "Limits", "Refusals", "Request", "RequestTimeout", "Response", "Routed", "Router",
    "Server", "TLSConfig",
    "TransportError", "call", "make_certs", "message_response", "problem_response", "serve",
]
