"""HTTP/2 and HTTP/3 with mutual TLS 1.3: the only part of sdcp-fast that touches sockets
(plain-HTTP pages for clients and scrapers: `asgi.serve_web`, through hypercorn).

Server side: `serve(handler, *, host, port, tls, http3, http2, limits, refusals, **overrides)`
runs a `Handler` (`async handle(Request) -> Response`), as a rule a `Router` whose
`add_message` routes decode and encode the messages (roles never see CBOR), guarded by an
`Authorizer`. The caller is the single URI SAN of the client certificate (certpolicy.py). The
transport answers itself what it can know without the role (a malformed request resets its
stream; 431, 413, 415, 400, 408); a ProblemError raised by the handler becomes its problem
document, any other exception a logged 500. `Limits` holds every limit against hostile
clients; `Refusals` counts every refusal by kind.

Client side: `Client(tls, "h2" | "h3", ...)`; `await client.request(...)` -> ClientResponse, or
TransportError(sent=...) / RequestTimeout, retried only when safe; `await call(client, method,
url, message, AnswerType)` -> `Reply` is the typed form. Certificates: `make_certs`,
`sdcp-fast certs --dir DIR URI...`, `TLSConfig`.
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
