"""HTTP/2 and HTTP/3 with mutual TLS 1.3: the only part of sdcp-fast that touches sockets.

Server: `serve(handler, ...)` (server.py) runs a `Handler`, as a rule a `Router` (http.py),
held to `Limits` with every refusal counted in `Refusals`. Client: `Client` and `call`
(client.py). Certificates: `make_certs`, `sdcp-fast certs`, `TLSConfig`. Plain-HTTP pages
for clients and scrapers: `asgi.serve_web`.
"""

from .certs import CertPaths, make_certs
from .client import Client, ClientResponse, Reply, RequestTimeout, TransportError, call
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
    "ANY_CALLER", "SDCP_MEDIA_TYPE", "Authorizer", "Call", "CertPaths", "Reply", "Client",
    "ClientResponse", "Handler", "Limits", "Refusals", "Request", "RequestTimeout", "Response", "Routed", "Router",
    "Server", "TLSConfig", "TransportError", "call", "make_certs", "message_response", "problem_response", "serve",
]
