"""What every HTTP client adapter answers with, below both adapters: the response, and the
errors that say no response came (and whether the server may have processed the request)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Problem

from .http import media_type

DEFAULT_MAX_RESPONSE = 16 << 20
# A request body at least this long announces its length (content-length), so that a server
# can refuse one over its limit before the upload; a shorter one (every SDCP round) does not:
# HTTP/2 and HTTP/3 frame the content, and the field costs HPACK/QPACK work at both ends
ANNOUNCE_LENGTH_FROM = 16 << 10


@functools.lru_cache(maxsize=1024)
def split_https_url(url: str) -> tuple[tuple[str, int], str, str]:
    """((host, port) of the origin, :authority, :path) of an https URL; ValueError otherwise.
    Cached: a drafter posts to the same few URLs every round, and urlsplit is ~20 Python
    calls (a refused URL raises, and lru_cache keeps no exceptions)."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"not an https URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, parts.port or 443), parts.netloc.rpartition("@")[2], path


def read_answer_head(headers, into: dict[str, str]) -> int:
    """An answer's header fields into `into` (names lowercased, the last value of a repeated
    one) and its status, 0 when it has none that is three digits (a malformed answer)."""
    status = 0
    for name, value in headers:
        if name == b":status":
            status = int(value) if len(value) == 3 and value.isdigit() else 0
        elif name[:1] != b":":
            into[name.decode("latin-1").lower()] = value.decode("latin-1")
    return status


class TransportError(Exception):
    """No HTTP response. `sent` is False when the server certainly did not process the request."""

    def __init__(self, message: str, *, sent: bool):
        super().__init__(message)
        self.sent = sent


class RequestTimeout(TransportError):
    pass


@dataclass(frozen=True)
class ClientResponse:
    status: int
    headers: dict[str, str]  # lower-case names; the last value of a repeated header
    body: bytes

    @property
    def content_type(self) -> str | None:
        return media_type(self.headers.get("content-type"))

    def problem(self) -> Problem | None:
        """The RFC 9457 document of an error answer, or None."""
        if self.status < 400 or self.content_type != PROBLEM_MEDIA_TYPE:
            return None
        try:
            return Problem.from_json(self.body)
        except ValueError:
            return None
