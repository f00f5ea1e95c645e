"""One request as it arrives on a stream, shared by the HTTP/2 and HTTP/3 servers.

Both protocols deliver a header block, then body chunks, then an end. `IncomingRequest`
turns that into a `Request`, deciding 400 (malformed header block), 413 and 415 as early as
the bytes allow: 413 on a declared content-length before any body byte, or as soon as the
received bytes pass the limit, so memory per stream never exceeds max_body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sdcp_fast.core.problems import Kind, Problem

from .http import (
    Handler,
    Request,
    Response,
    dispatch,
    media_type,
    parse_query,
    precheck,
    problem_response,
)

log = logging.getLogger("sdcp_fast.transport")

HeaderList = list[tuple[bytes, bytes]]
MAX_PATH = 2048


@dataclass
class IncomingRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    max_body: int
    body: bytearray = field(default_factory=bytearray)

    @classmethod
    def from_headers(cls, headers: HeaderList, max_body: int) -> IncomingRequest | Problem:
        pseudo: dict[bytes, bytes] = {}
        content_type: str | None = None
        content_length: int | None = None
        for name, value in headers:
            if name.startswith(b":"):
                pseudo[name] = value
            elif name == b"content-type":
                content_type = media_type(value.decode("latin-1"))
            elif name == b"content-length":
                try:
                    content_length = int(value)
                except ValueError:
                    return Problem(Kind.BAD_REQUEST, "content-length is not a number")
        method = pseudo.get(b":method", b"").decode("ascii", "replace")
        target = pseudo.get(b":path", b"").decode("ascii", "replace")
        if not method or not target.startswith("/") or len(target) > MAX_PATH:
            return Problem(Kind.BAD_REQUEST, "missing or invalid :method or :path")
        path, _, raw_query = target.partition("?")
        try:
            query = parse_query(raw_query)
        except ValueError as exc:  # too many fields
            return Problem(Kind.BAD_REQUEST, f"bad query: {exc}")
        refusal = precheck(method, content_type, content_length, max_body)
        if refusal is not None:
            return refusal
        return cls(method, path, query, content_type, max_body)

    def add_body(self, data: bytes) -> Problem | None:
        if len(self.body) + len(data) > self.max_body:
            return Problem(Kind.TOO_LARGE, f"body exceeds the limit of {self.max_body} bytes")
        self.body += data
        return None

    def finish(self, caller: str | None) -> Request:
        return Request(self.method, self.path, self.query, self.content_type, bytes(self.body), caller)


async def respond_to(handler: Handler, request: Request, timeout: float | None) -> Response:
    """Run the handler with the server's time limit; log one line per request."""
    try:
        response = await asyncio.wait_for(dispatch(handler, request), timeout)
    except TimeoutError:
        log.warning("handler timed out after %ss on %s %s", timeout, request.method, request.path)
        response = problem_response(Problem(Kind.UNAVAILABLE, "handler timed out"))
    log.debug("%s %s from %s -> %d (%d bytes)", request.method, request.path, request.caller,
              response.status, len(response.body))
    return response


def response_headers(response: Response) -> HeaderList:
    headers: HeaderList = [(b":status", str(response.status).encode())]
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type.encode()))
    headers.append((b"content-length", str(len(response.body)).encode()))
    headers.extend((name.lower().encode(), value.encode()) for name, value in response.headers)
    return headers


class PendingBodies:
    """Requests whose body is still arriving, each with a deadline: `on_overdue(stream_id)`
    runs if the body is not complete `timeout` seconds after the headers (both servers
    answer 408 then). Shared by the HTTP/2 and HTTP/3 servers."""

    def __init__(self, timeout: float, on_overdue: Callable[[int], None]):
        self._timeout = timeout
        self._on_overdue = on_overdue
        self._requests: dict[int, IncomingRequest] = {}
        self._deadlines: dict[int, asyncio.TimerHandle] = {}

    def add(self, stream_id: int, incoming: IncomingRequest) -> None:
        self._requests[stream_id] = incoming
        self._deadlines[stream_id] = asyncio.get_running_loop().call_later(
            self._timeout, self._overdue, stream_id)

    def get(self, stream_id: int) -> IncomingRequest | None:
        return self._requests.get(stream_id)

    def take(self, stream_id: int) -> IncomingRequest | None:
        """The stream's body is no longer awaited: forget it and its deadline."""
        deadline = self._deadlines.pop(stream_id, None)
        if deadline is not None:
            deadline.cancel()
        return self._requests.pop(stream_id, None)

    def clear(self) -> None:
        for stream_id in list(self._requests):
            self.take(stream_id)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(list(self._requests))

    def _overdue(self, stream_id: int) -> None:
        self._deadlines.pop(stream_id, None)
        if self._requests.pop(stream_id, None) is not None:
            self._on_overdue(stream_id)
