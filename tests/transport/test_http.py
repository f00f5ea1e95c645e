"""Pure parts of the transport: routing, authorization, header prechecks, the aioquic guard."""

from __future__ import annotations

import asyncio
import json

import pytest

from sdcp_fast.core.problems import Kind, ProblemError
from sdcp_fast.transport import Authorizer, Request, Response, Router
from sdcp_fast.transport.exchange import IncomingRequest, Malformed
from sdcp_fast.transport.http import failure_response

ROUTER = "https://router-1.example/"
DRAFTER = "https://drafter-1.example/"


def _request(method, path, caller=ROUTER, body=b"", query=None):
    return Request(method, path, query or {}, "application/sdcp+cbor", body, caller)


def _verifier_router() -> Router:
    auth = Authorizer({"sessions": {ROUTER}, "drafter": {ROUTER}, "policy": {ROUTER}, "proposals": {"*"}})
    router = Router(prefix="/v1", authorizer=auth)

    async def echo(request, **params):
        return Response(200, json.dumps({"path": request.path, **params}).encode(), "application/json")

    router.add("POST", "/sessions", echo, resource="sessions")
    router.add("PUT", "/sessions/{id}/drafter", echo, resource="drafter")
    router.add("POST", "/sessions/{id}/policy", echo, resource="policy")
    router.add("POST", "/proposals", echo, resource="proposals")
    router.add("GET", "/sessions/{id}/output", echo)
    return router


def _answer(router, request) -> Response:
    """The handler's answer as a server gives it (a ProblemError its document, else a 500)."""
    async def answer() -> Response:
        try:
            return await router.handle(request)
        except Exception as exc:
            return failure_response(request, exc)

    return asyncio.run(answer())


def test_router_matches_and_extracts_parameters():
    response = _answer(_verifier_router(), _request("PUT", "/v1/sessions/AAECAw/drafter"))
    assert response.status == 200
    assert json.loads(response.body) == {"path": "/v1/sessions/AAECAw/drafter", "id": "AAECAw"}


def test_router_first_match_wins_for_paths_without_parameters():
    """A path without parameters is found by lookup; a route added earlier whose pattern
    also matches it still wins, as the in-order match would have it."""
    router = Router()

    def answer(name):
        async def fn(request, **params):
            return Response(200, json.dumps([name, params]).encode(), "application/json")
        return fn

    router.add("GET", "/items/{id}", answer("item"))
    router.add("GET", "/items/new", answer("new"))   # shadowed by the route above
    router.add("GET", "/all", answer("all"))
    assert json.loads(_answer(router, _request("GET", "/items/new")).body) == ["item", {"id": "new"}]
    assert json.loads(_answer(router, _request("GET", "/all")).body) == ["all", {}]
    assert _answer(router, _request("POST", "/all")).status == 405
    assert router.resource_of("GET", "/all") is None and router.resource_of("GET", "/none") is None


@pytest.mark.parametrize(("method", "path", "status", "allow"), [
    ("GET", "/v1/nothing", 404, None),
    ("GET", "/sessions", 404, None),  # outside the prefix
    ("GET", "/v1/sessions/a/b/drafter", 404, None),  # {id} never spans a slash
    ("GET", "/v1/sessions", 405, "POST"),
    ("DELETE", "/v1/sessions/x/drafter", 405, "PUT"),
])
def test_router_404_405(method, path, status, allow):
    response = _answer(_verifier_router(), _request(method, path))
    assert response.status == status
    assert response.content_type == "application/problem+json"
    assert dict(response.headers).get("allow") == allow


def test_authorization_by_resource_class():
    router = _verifier_router()
    assert _answer(router, _request("POST", "/v1/sessions", caller=ROUTER)).status == 200
    refused = _answer(router, _request("POST", "/v1/sessions", caller=DRAFTER))
    assert refused.status == 403
    assert json.loads(refused.body)["type"].endswith(":forbidden")
    assert DRAFTER in json.loads(refused.body)["detail"]
    assert _answer(router, _request("POST", "/v1/proposals", caller=DRAFTER)).status == 200
    assert _answer(router, _request("POST", "/v1/proposals", caller=None)).status == 403


def test_authorizer_fails_closed_for_unknown_resources():
    auth = Authorizer({"sessions": [ROUTER]})
    auth.check(ROUTER, "sessions")
    with pytest.raises(ProblemError) as info:
        auth.check(ROUTER, "events")
    assert info.value.problem.kind is Kind.FORBIDDEN


def test_route_with_resource_needs_authorizer_and_no_duplicates():
    router = Router()

    async def fn(request):
        return Response(204, b"", None)

    with pytest.raises(ValueError, match="authorizer"):
        router.add("POST", "/x", fn, resource="x")
    router.add("POST", "/x", fn)
    with pytest.raises(ValueError, match="duplicate"):
        router.add("post", "/x", fn)


H = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"h"), (b":path", b"/p?from=3&x=")]


@pytest.mark.parametrize(("headers", "outcome"), [
    (H + [(b"content-type", b"application/SDCP+CBOR; x=1")], "ok"),
    (H + [(b"content-type", b"application/sdcp+cbor"), (b"content-length", b"101")], Kind.TOO_LARGE),
    (H + [(b"content-type", b"application/sdcp+cbor"), (b"content-length", b"1e3")], Malformed),
    (H + [(b"content-type", b"text/plain")], Kind.UNSUPPORTED_MEDIA_TYPE),
    (H, Kind.UNSUPPORTED_MEDIA_TYPE),
    (H[:3] + [(b":path", b"p")], Kind.BAD_REQUEST),
    ([(b":method", b"POST"), (b":path", b"/p")], Malformed),     # no :scheme
    ([(b":path", b"/p")], Malformed),
    (H + [(b"x-big", b"v" * 600)], Kind.HEADERS_TOO_LARGE),
])
def test_incoming_request_prechecks(headers, outcome):
    incoming = IncomingRequest.from_headers(headers, max_header_list=512, body_limit=lambda m, p: 100)
    if outcome == "ok":
        assert (incoming.method, incoming.path, incoming.query) == ("POST", "/p", {"from": "3", "x": ""})
        assert incoming.content_type == "application/sdcp+cbor"
        assert incoming.add_body(b"a" * 60) is None
        assert incoming.add_body(b"a" * 41).kind is Kind.TOO_LARGE
        assert len(incoming.body) == 60  # the refused chunk was never kept
    elif outcome is Malformed:
        assert isinstance(incoming, Malformed)
    else:
        assert incoming.kind is outcome


def test_get_without_content_type_is_fine():
    incoming = IncomingRequest.from_headers([(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/o")],
                                            max_header_list=1024, body_limit=lambda m, p: 0)
    assert incoming.content_type is None and incoming.too_large(0) is None
