"""One request as it arrives on a stream, shared by the HTTP/2 and HTTP/3 servers.

Both protocols deliver a header block, then body chunks, then an end. `IncomingRequest`
turns that into a `Request`, deciding as early as the bytes allow: a malformed header block
(RFC 9113 8.2-8.3, checked here for both protocols) is a stream error, 431 a header list
over the advertised limit, 400 a bad path or query, 413 a declared content-length over the
limit of the resource the request goes to (before any body byte) or received bytes passing
it, 415 a body that is not SDCP's. Memory per stream never exceeds the resource's limit.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from sdcp_fast.core.problems import Kind, Problem

from .http import Response, media_type, parse_query, precheck

HeaderList = list[tuple[bytes, bytes]]
MAX_PATH = 2048
REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})
CONNECTION_SPECIFIC = frozenset({b"connection", b"proxy-connection", b"keep-alive",
                                 b"transfer-encoding", b"upgrade"})
# what a field name may hold: bytes.translate deleting these leaves nothing (one C call,
# not a set operation over the name's bytes)
_TOKEN = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
# a forbidden character anywhere in a value, or whitespace around it
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")


@dataclass(frozen=True)
class Malformed:
    """A request that breaks RFC 9113 8.2-8.3 / RFC 9114 4.2-4.3: a stream error
    (HTTP/2 RST_STREAM PROTOCOL_ERROR, HTTP/3 H3_MESSAGE_ERROR) on its own stream only."""

    reason: str


def malformed(headers: HeaderList) -> str | None:
    """Why a request header block is malformed (RFC 9113 8.2.1, 8.2.2, 8.3.1), or None."""
    seen_pseudo: set[bytes] = set()
    regular = False
    lengths: set[bytes] = set()
    for name, value in headers:
        if not name:
            return "empty field name"
        if name[0] == 0x3A:  # b":"
            if regular:
                return f"pseudo-header {name!r} after a regular field"
            if name not in REQUEST_PSEUDO:
                return f"unknown pseudo-header {name!r}"
            if name in seen_pseudo:
                return f"pseudo-header {name!r} twice"
            seen_pseudo.add(name)
        else:
            regular = True
            if name.translate(None, _TOKEN):
                return f"field name {name[:64]!r} is not a lowercase token"
            if name in CONNECTION_SPECIFIC:
                return f"connection-specific field {name!r}"
            if name == b"te" and value != b"trailers":
                return "te other than trailers"
            if name == b"content-length":
                if not value.isdigit():
                    return "content-length is not a number"
                lengths.add(value.lstrip(b"0") or b"0")
        if _BAD_VALUE.search(value) is not None:
            return f"field {name[:64]!r} has a forbidden character or surrounding whitespace"
    if len(lengths) > 1:
        return "conflicting content-length fields"
    missing = {b":method", b":scheme", b":path"} - seen_pseudo
    if missing:
        return f"missing {b', '.join(sorted(missing)).decode()}"
    return None


@dataclass
class IncomingRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    max_body: int
    head: bool = False  # a HEAD request: the answer carries no content (RFC 9110 9.3.2)
    content_length: int | None = None   # as declared
    body: bytearray = field(default_factory=bytearray)
    deadline: asyncio.TimerHandle | None = None   # while the body is awaited: its body_timeout

    @classmethod
    def from_headers(cls, headers: HeaderList, *, max_header_list: int,
                     body_limit: Callable[[str, str], int]) -> IncomingRequest | Problem | Malformed:
        """The request a header block opens: a `Malformed` one is reset, a `Problem` answered
        (431, 400, 413, 415) before any body byte is kept."""
        reason = malformed(headers)
        if reason is not None:
            return Malformed(reason)
        # RFC 9113 6.5.2: name and value lengths plus 32 per field, without a call per field
        size = sum(map(len, chain.from_iterable(headers))) + 32 * len(headers)
        if size > max_header_list:
            return Problem(Kind.HEADERS_TOO_LARGE, f"header list of {size} bytes exceeds the limit of {max_header_list}")
        # by name, the last value winning: malformed() has checked that each pseudo-header
        # came once and that every content-length says the same
        fields = dict(headers)
        raw_type = fields.get(b"content-type")
        content_type = None if raw_type is None else media_type(raw_type.decode("latin-1"))
        raw_length = fields.get(b"content-length")
        content_length = None if raw_length is None else int(raw_length)
        method = fields[b":method"].decode("ascii", "replace")
        target = fields[b":path"].decode("ascii", "replace")
        if not method or not target.startswith("/") or len(target) > MAX_PATH:
            return Problem(Kind.BAD_REQUEST, "invalid :method or :path")
        path, _, raw_query = target.partition("?")
        try:
            query = parse_query(raw_query)
        except ValueError as exc:  # too many fields
            return Problem(Kind.BAD_REQUEST, f"bad query: {exc}")
        max_body = body_limit(method, path)
        refusal = precheck(method, content_type, content_length, max_body)
        if refusal is not None:
            return refusal
        return cls(method, path, query, content_type, max_body, head=method == "HEAD", content_length=content_length)

    def add_body(self, data: bytes) -> Problem | None:
        """413 once the body would pass the limit (the chunk is not kept), else None."""
        problem = self.too_large(len(self.body) + len(data))
        if problem is None:
            self.body += data
        return problem

    def too_large(self, size: int) -> Problem | None:
        """413 for a body of `size` bytes over the limit, else None."""
        return Problem(Kind.TOO_LARGE, f"body exceeds the limit of {self.max_body} bytes") if size > self.max_body else None


class BoundedMemo(dict):
    """A memo of at most `size` entries, all forgotten at once when it is full (a peer cycling
    through new keys costs one miss each, never more memory; no bookkeeping per hit)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def add(self, key, value=None) -> None:
        if len(self) >= self.size:
            self.clear()
        self[key] = value


class RequestHeads:
    """`IncomingRequest.from_headers` for one server, remembered by the header fields (a
    session sends the same fields with each of its proposals): a remembered head is shared,
    not to be changed (a request whose body is awaited gets a copy of its own); a refusal
    (`Problem`, `Malformed`) is worked out each time. Bounded: `REMEMBER` header lists of at
    most `REMEMBER_SIZE` bytes."""

    REMEMBER = 512
    REMEMBER_SIZE = 1024

    def __init__(self, max_header_list: int, body_limit: Callable[[str, str], int]):
        self._max_header_list = max_header_list
        self._body_limit = body_limit
        self._known: BoundedMemo = BoundedMemo(self.REMEMBER)

    def head(self, headers: HeaderList) -> IncomingRequest | Problem | Malformed:
        key = tuple(headers)
        head = self._known.get(key)
        if head is None:
            head = IncomingRequest.from_headers(headers, max_header_list=self._max_header_list,
                                                body_limit=self._body_limit)
            if head.__class__ is not IncomingRequest:
                return head
            if sum(map(len, chain.from_iterable(key))) <= self.REMEMBER_SIZE:
                self._known.add(key, head)
        return head


def response_headers(response: Response) -> HeaderList:
    """The header block of `response`: its status, content-type and extra headers, without
    content-length (HTTP/2 and HTTP/3 frame the content: RFC 9113 8.1.1, RFC 9114 4.1.2). A
    HEAD answer has the same fields without content (RFC 9110 9.3.2)."""
    headers: HeaderList = [(b":status", str(response.status).encode())]
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type.encode()))
    if response.headers:   # most answers carry none (no generator for them)
        headers.extend((name.lower().encode(), value.encode()) for name, value in response.headers)
    return headers
