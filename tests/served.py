"""A service's answer to a request as the servers give it, for tests that call a role in
process (no sockets): the handler awaited, a ProblemError answered with its document and
anything else with a logged 500 (`transport.http.failure_response`, the rule the request
lifecycle of both servers applies)."""

from __future__ import annotations

from sdcp_fast.transport.http import Handler, Request, Response, failure_response


async def served(handler: Handler, request: Request) -> Response:
    try:
        return await handler.handle(request)
    except Exception as exc:
        return failure_response(request, exc)
