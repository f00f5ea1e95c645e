"""The one HTTP client every role uses: HTTP/2 (httpx) or HTTP/3 (aioquic), with mutual TLS 1.3.

Connections are kept per origin and reused; requests on one connection run as concurrent
streams. Every attempt, connection set-up and whole response included, ends within
`timeout` seconds (asyncio.timeout around it): httpx's own timeouts bound each read, so a
server trickling a byte at a time would otherwise hold a request forever. A failed attempt is retried (up to `retries`
times, short exponential backoff) only when that is safe: always when the request certainly
never reached the server (connect failure, stream refused by a closing server), and otherwise
only when the caller says the request is idempotent (`idempotent=True`: proposals are
idempotent per round, section 6.9; GETs are safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Problem

from .http import SDCP_MEDIA_TYPE, media_type
from .tlsconfig import TLSConfig

log = logging.getLogger("sdcp_fast.transport")
DEFAULT_MAX_RESPONSE = 16 << 20


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


class Client:
    def __init__(
        self,
        tls: TLSConfig,
        protocol: Literal["h2", "h3"] = "h2",
        *,
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        idle_timeout: float = 600.0,
        max_response: int = DEFAULT_MAX_RESPONSE,
    ):
        if protocol not in ("h2", "h3"):
            raise ValueError(f"protocol must be 'h2' or 'h3', not {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout
        self.retries = retries
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._max_response = max_response
        self._httpx: httpx.AsyncClient | None = None
        self._h3: dict[tuple[str, int], Any] = {}  # origin -> _H3ClientConnection
        self._h3_locks: dict[tuple[str, int], asyncio.Lock] = {}
        if protocol == "h2":
            self._httpx = httpx.AsyncClient(
                http1=False,
                http2=True,
                verify=tls.client_ssl_context(),
                timeout=httpx.Timeout(timeout, connect=connect_timeout),
                limits=httpx.Limits(max_connections=16, max_keepalive_connections=16,
                                    keepalive_expiry=idle_timeout),
                trust_env=False,
            )

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        content_type: str | None = SDCP_MEDIA_TYPE,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> ClientResponse:
        """One HTTP exchange; raises TransportError (or RequestTimeout) when no response came."""
        method = method.upper()
        idempotent = idempotent or method in ("GET", "HEAD")
        limit = self.timeout if timeout is None else timeout
        for attempt in range(self.retries + 1):
            try:
                return await self._attempt(method, url, body, content_type, limit)
            except TransportError as exc:
                if attempt == self.retries or not (idempotent or not exc.sent):
                    raise
                log.info("retrying %s %s after: %s", method, url, exc)
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        for connection in list(self._h3.values()):
            await connection.aclose()
        self._h3.clear()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _attempt(self, method: str, url: str, body: bytes | None,
                       content_type: str | None, limit: float) -> ClientResponse:
        """One try, all of it within `limit` seconds."""
        # httpx does not say how far a request got when it is cancelled: assume it was sent.
        sent = self.protocol == "h2"
        try:
            async with asyncio.timeout(limit):
                if self.protocol == "h2":
                    return await self._request_h2(method, url, body, content_type, limit)
                connection, authority, target = await self._h3_target(url)
                sent = True
                return await connection.request(method, authority, target, body, content_type,
                                                limit, self._max_response)
        except TimeoutError as exc:
            raise RequestTimeout(f"no complete answer to {method} {url} within {limit}s",
                                 sent=sent) from exc

    # ---- HTTP/2 -----------------------------------------------------------------------
    async def _request_h2(self, method: str, url: str, body: bytes | None,
                          content_type: str | None, limit: float) -> ClientResponse:
        assert self._httpx is not None
        headers = {"content-type": content_type} if body is not None and content_type else {}
        try:
            request = self._httpx.build_request(method, url, content=body, headers=headers,
                                                timeout=httpx.Timeout(limit, connect=self._connect_timeout))
            response = await self._httpx.send(request, stream=True)
            try:
                data = bytearray()
                async for chunk in response.aiter_raw():
                    data += chunk
                    if len(data) > self._max_response:
                        raise TransportError(f"response over {self._max_response} bytes", sent=True)
            finally:
                await response.aclose()
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise RequestTimeout(f"{type(exc).__name__} to {url}", sent=False) from exc
        except httpx.TimeoutException as exc:
            raise RequestTimeout(f"{type(exc).__name__} on {method} {url}", sent=True) from exc
        except httpx.ConnectError as exc:
            raise TransportError(f"cannot connect to {url}: {exc}", sent=False) from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__} on {method} {url}: {exc}",
                                 sent=not _refused_stream(exc)) from exc
        return ClientResponse(response.status_code, {k.lower(): v for k, v in response.headers.items()},
                              bytes(data))

    # ---- HTTP/3 -----------------------------------------------------------------------
    async def _h3_target(self, url: str):
        """(connection to the URL's origin, :authority, :path) for an HTTP/3 request."""
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"not an https URL: {url!r}")
        origin = (parts.hostname, parts.port or 443)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection = await self._h3_connection(origin)
        return connection, parts.netloc.rpartition("@")[2], target

    async def _h3_connection(self, origin: tuple[str, int]):
        from .client_h3 import connect_h3

        lock = self._h3_locks.setdefault(origin, asyncio.Lock())
        async with lock:
            connection = self._h3.get(origin)
            if connection is not None and connection.usable:
                return connection
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.aclose()
            configuration = self._tls.quic_configuration(is_client=True, idle_timeout=self._idle_timeout)
            connection = await connect_h3(origin[0], origin[1], configuration, self._connect_timeout,
                                          ca_file=self._tls.ca)
            self._h3[origin] = connection
            return connection


def _refused_stream(exc: httpx.TransportError) -> bool:
    """RST_STREAM(REFUSED_STREAM): the server did not process the request (RFC 9113 8.7)."""
    import h2.errors
    import h2.events

    event = exc.__cause__.args[0] if exc.__cause__ is not None and exc.__cause__.args else None
    return isinstance(event, h2.events.StreamReset) and event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
