"""HTTP/2 and HTTP/3 with mutual TLS 1.3: the only part of sdcp-fast that touches sockets.
(Plain-HTTP pages for clients and scrapers: `asgi.serve_web`, through hypercorn.)

Server side: `serve(handler, *, host, port, tls, http3=True, http2=True, limits=Limits(),
refusals=None, **limit_overrides) -> Server` runs a `Handler` (`async handle(Request) ->
Response`), usually a `Router` (404/405 answered for it; `add_message` routes decode the
body into their message type and encode the answer, so roles never see CBOR) guarded by an
`Authorizer`. The caller is the single URI SAN of the client certificate, checked by one
policy on both protocols (certpolicy.py). The transport answers itself: a malformed request
with a reset of its stream, 431, 413 (decided from content-length or as bytes arrive), 415
(POST/PUT without application/sdcp+cbor), 400 (bad path or query) and 408 (body not complete
within body_timeout); a ProblemError raised by the handler becomes its problem document, any
other exception a logged 500. `Limits` holds every limit against hostile clients (the
config's [transport] table); `Refusals` counts every refusal by kind.

Client side: `Client(tls, "h2" | "h3", *, timeout, connect_timeout, retries, idle_timeout,
max_response)`; `await client.request(method, url, body, content_type, *, idempotent,
timeout) -> ClientResponse` raises TransportError(sent=...) / RequestTimeout and retries only
when safe; each attempt, connection set-up included, ends within `timeout`. `await
call(client, method, url, message, AnswerType)` -> `Reply` is the typed form roles use.

Certificates: `make_certs(directory, instances)`, `sdcp-fast certs --dir DIR URI...`,
`TLSConfig(cert, key, ca)` / `TLSConfig.for_instance(directory, uri)`.
"""

from .certs import CertPaths, make_certs
from .client import Client, ClientResponse, Reply, RequestTimeout, TransportError, call
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
