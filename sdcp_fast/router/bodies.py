"""What both client doors (frontdoor.py, openai_api.py) read from a request the same way: a
JSON object body, JSON integers (true is not 1), and where a resumed stream starts. Each door
answers bad input in its own error shape: `error(status, message)` builds the exception."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..transport.asgi import WebRequest

ErrorFactory = Callable[[int, str], Exception]


def json_object(body: bytes, error: ErrorFactory) -> dict:
    """The body as a JSON object (an empty body is {}); 400 otherwise."""
    try:
        obj = json.loads(body or b"{}")
    except ValueError:
        raise error(400, "the body is not JSON") from None
    if not isinstance(obj, dict):
        raise error(400, "the body must be a JSON object")
    return obj


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # JSON true is not 1


def resume_index(request: WebRequest, error: ErrorFactory) -> int:
    """Where a resumed stream starts: `?from=n`, else the SSE header Last-Event-ID, else 0;
    a non-negative decimal integer (400 otherwise)."""
    text = request.query.get("from", request.headers.get("last-event-id", "0"))
    if not text.isascii() or not text.isdecimal():
        raise error(400, "from (or Last-Event-ID) must be a non-negative integer")
    return int(text)
