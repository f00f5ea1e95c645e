"""What a transport server hands to role code and takes back: Request, Response, Handler;
resources (404/405) are `Router`'s business, who may call what `Authorizer`'s.

`Router.add_message` is the typed layer the roles use: the route declares the message type
of its body, the router decodes it strictly (a bad body is the message type's 400 or 422)
and encodes what the role returns:

    router.add_message("POST", "/proposals", propose, body=Proposal, resource="proposals")
    async def propose(call: Call, proposal: Proposal) -> Verdict: ...   # -> 200 CBOR
    async def put_status(call: Call, status: Status, iid: str) -> None: ...  # -> 204
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Kind, Problem, ProblemError

SDCP_MEDIA_TYPE = "application/sdcp+cbor"
BODY_METHODS = frozenset({"POST", "PUT"})
log = logging.getLogger("sdcp_fast.transport")


@dataclass(frozen=True)
class Request:
    method: str  # "GET", "POST", ...
    path: str  # as sent, without the query, e.g. "/sessions/AAEC/drafter" (ids are base64url)
    query: dict[str, str]  # last value wins for repeated names
    content_type: str | None  # media type without parameters, lower case; None if absent
    body: bytes  # at most the server's max_body bytes
    caller: str | None  # URI SAN of the verified client certificate


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = SDCP_MEDIA_TYPE  # None: no content-type header (e.g. 204)
    headers: tuple[tuple[str, str], ...] = ()  # extra headers, lower-case names


class Handler(Protocol):
    async def handle(self, request: Request) -> Response: ...


@dataclass(frozen=True)
class Call:
    """What a message route receives besides its message and path parameters."""

    caller: str | None  # URI SAN of the verified client certificate
    query: dict[str, str]


class Message(Protocol):
    """A core message type (sdcp_fast.core.messages): strict decode, deterministic encode."""

    @classmethod
    def from_cbor(cls, data: bytes) -> Message: ...

    def to_cbor(self) -> bytes: ...


def message_response(result: Message | Response | None) -> Response:
    """A message -> 200 application/sdcp+cbor; None -> 204; a Response as it is."""
    if result is None:
        return Response(204, content_type=None)
    if isinstance(result, Response):
        return result
    return Response(200, result.to_cbor(), SDCP_MEDIA_TYPE)


def problem_response(problem: Problem, headers: Iterable[tuple[str, str]] = ()) -> Response:
    """RFC 9457 document for `problem`, status from its kind."""
    return Response(problem.status, problem.to_json(), PROBLEM_MEDIA_TYPE, tuple(headers))


def body_timeout_response(timeout: float) -> Response:
    """408: the request body did not arrive in time (no SDCP problem kind: plain RFC 9457)."""
    body = json.dumps({"type": "about:blank", "title": "Request Timeout", "status": 408,
                       "detail": f"request body not received within {timeout:g}s"},
                      sort_keys=True, separators=(",", ":")).encode()
    return Response(408, body, PROBLEM_MEDIA_TYPE)


def media_type(header_value: str | None) -> str | None:
    """`application/sdcp+cbor; foo=bar` -> `application/sdcp+cbor`."""
    if header_value is None:
        return None
    return header_value.split(";", 1)[0].strip().lower() or None


def parse_query(raw: str) -> dict[str, str]:
    if not raw:   # most requests (every proposal) have none
        return {}
    from urllib.parse import parse_qsl

    return dict(parse_qsl(raw, keep_blank_values=True, max_num_fields=32))


def precheck(method: str, content_type: str | None, content_length: int | None, max_body: int) -> Problem | None:
    """The transport's own answers, decided from headers alone (before any body byte is kept)."""
    if content_length is not None and content_length > max_body:
        return Problem(Kind.TOO_LARGE, f"body of {content_length} bytes exceeds the limit of {max_body}")
    if method in BODY_METHODS and content_type != SDCP_MEDIA_TYPE:
        return Problem(Kind.UNSUPPORTED_MEDIA_TYPE, f"got {content_type or 'no content-type'}")
    return None


async def dispatch(handler: Handler, request: Request) -> Response:
    """A handler's answer as the servers give it, for callers in the same process (the
    benchmarks and tests that drive a role without sockets): `failure_response` on failure."""
    try:
        return await handler.handle(request)
    except Exception as exc:
        return failure_response(request, exc)


def failure_response(request: Request, exc: Exception) -> Response:
    """What an exception out of a handler answers: a ProblemError its document, anything
    else a logged 500."""
    if isinstance(exc, ProblemError):
        return problem_response(exc.problem)
    log.error("handler failed on %s %s from %s", request.method, request.path, request.caller, exc_info=exc)
    return Response(500, b'{"status":500,"title":"Internal Server Error","type":"about:blank"}', PROBLEM_MEDIA_TYPE)


def handler_entry(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """What a server calls per request for the awaitable that answers it: a `Routed` handler's
    router's `start` unless its class answers in its own way (it may raise, as `handle` may)."""
    if isinstance(handler, Routed) and type(handler).handle is Routed.handle:
        return handler.router.start
    return handler.handle


# ---- authorization -------------------------------------------------------------------

ANY_CALLER = "*"
_NOBODY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Authorizer:
    """Which identities may call which resource class, e.g. `Authorizer({"sessions":
    {"https://router-1.example/"}, "proposals": {"*"}})`; "*" admits any authenticated caller,
    a resource class missing from the map nobody (the configuration fails closed)."""

    rules: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", {k: frozenset(v) for k, v in self.rules.items()})

    def check(self, caller: str | None, resource: str) -> None:
        allowed = self.rules.get(resource, _NOBODY)
        if caller is None or (ANY_CALLER not in allowed and caller not in allowed):
            raise ProblemError(Problem(Kind.FORBIDDEN, f"{caller or 'anonymous'} may not use {resource}"))


# ---- routing -------------------------------------------------------------------------

RouteFn = Callable[..., Awaitable[Response]]
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class _Route:
    pattern: re.Pattern[str]
    methods: dict[str, tuple[RouteFn, str | None]]  # method -> (coroutine fn, resource class)


class Router:
    """A Handler that maps (method, path pattern) to coroutines, with 404/405 answers:
    `router.add("PUT", "/sessions/{id}/drafter", fn, resource="drafter")`, `fn(request, id=...)`."""

    def __init__(self, *, prefix: str = "", authorizer: Authorizer | None = None):
        self._prefix = prefix.rstrip("/")
        self._authorizer = authorizer
        self._routes: dict[str, _Route] = {}
        # routes without parameters that no earlier route also matches, by path: found
        # with one dict lookup, not a regex per route (what the loop would find first)
        self._exact: dict[str, _Route] = {}

    def add(self, method: str, pattern: str, fn: RouteFn, *, resource: str | None = None) -> None:
        if resource is not None and self._authorizer is None:
            raise ValueError("a route with a resource class needs the Router's authorizer")
        full = self._prefix + "/" + pattern.lstrip("/")
        regex = "".join(
            f"(?P<{piece}>[^/]+)" if index % 2 else re.escape(piece)
            for index, piece in enumerate(_PARAM.split(full))
        )
        route = self._routes.get(full)
        if route is None:
            shadowed = any(r.pattern.match(full) for r in self._routes.values())
            route = self._routes[full] = _Route(re.compile(f"^{regex}$"), {})
            if not _PARAM.search(full) and not shadowed:
                self._exact[full] = route
        if method.upper() in route.methods:
            raise ValueError(f"duplicate route {method} {full}")
        route.methods[method.upper()] = (fn, resource)

    def add_message(self, method: str, pattern: str, fn: Callable[..., Awaitable[Message | Response | None]],
                    *, body: type[Message] | None = None, resource: str | None = None) -> None:
        """A typed route: `fn(call, [message,] **path_params)` returns a message (200), None
        (204) or a Response. `body` is the message type of the request body (None: none)."""

        async def route(request: Request, **params: str) -> Response:
            call = Call(request.caller, request.query)
            args = (call,) if body is None else (call, body.from_cbor(request.body))
            return message_response(await fn(*args, **params))

        self.add(method, pattern, route, resource=resource)

    def resource_of(self, method: str, path: str) -> str | None:
        """The resource class a request goes to (None: no route, or none declared); the
        server picks the body limit by it before reading the body."""
        route = self._exact.get(path) or next((r for r in self._routes.values() if r.pattern.match(path)), None)
        entry = route.methods.get(method) if route is not None else None
        return entry[1] if entry is not None else None

    async def handle(self, request: Request) -> Response:
        return await self.start(request)

    def start(self, request: Request) -> Awaitable[Response]:
        """What `handle` awaits for `request`: the route's own coroutine for a path without
        parameters, the matching one's otherwise; a refusal of the authorizer raises here."""
        exact = self._exact.get(request.path)
        entry = exact.methods.get(request.method) if exact is not None else None
        if entry is not None:
            return self._authorized(request, entry)(request)
        return self._matched(request, exact)

    def _authorized(self, request: Request, entry: tuple[RouteFn, str | None]) -> RouteFn:
        fn, resource = entry
        if resource is not None:
            self._authorizer.check(request.caller, resource)
        return fn

    async def _matched(self, request: Request, exact: _Route | None) -> Response:
        for route in (exact,) if exact is not None else self._routes.values():
            match = route.pattern.match(request.path)
            if match is None:
                continue
            entry = route.methods.get(request.method)
            if entry is None:
                allow = ", ".join(sorted(route.methods))
                problem = Problem(Kind.METHOD_NOT_ALLOWED, f"{request.method} not allowed; allow {allow}")
                return problem_response(problem, [("allow", allow)])
            return await self._authorized(request, entry)(request, **match.groupdict())
        raise ProblemError(Problem(Kind.NOT_FOUND, f"no resource at {request.path}"))


class Routed:
    """Base of a Handler that sends every request to its `router` (the roles' services); the
    server asks it for a request's resource class, whose body limit applies (limits.py)."""

    router: Router

    async def handle(self, request: Request) -> Response:
        return await self.router.start(request)

    def resource_of(self, method: str, path: str) -> str | None:
        return self.router.resource_of(method, path)
