"""HTTP/2 client adapter on httpx (mutual TLS 1.3): connections kept per origin and reused,
requests on one connection as concurrent streams."""

from __future__ import annotations

import h2.errors
import h2.events
import httpx

from .client_base import ClientResponse, RequestTimeout, TransportError
from .tlsconfig import TLSConfig


class H2Origins:
    def __init__(self, tls: TLSConfig, *, timeout: float, connect_timeout: float, idle_timeout: float,
                 max_response: int):
        self._connect_timeout = connect_timeout
        self._max_response = max_response
        self._httpx = httpx.AsyncClient(
            http1=False,
            http2=True,
            verify=tls.client_ssl_context(),
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            # let an idle connection go a little before a server with the same idle_timeout
            # closes it: httpx would write the next request onto the closing connection and
            # see only a read error, which a non-idempotent request cannot retry
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16,
                                keepalive_expiry=0.9 * idle_timeout),
            trust_env=False,
        )

    async def open(self, url: str) -> str:
        """httpx connects inside `send`: nothing to open first."""
        return url

    async def send(self, url: str, method: str, body: bytes | None, content_type: str | None,
                   limit: float) -> ClientResponse:
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

    async def aclose(self) -> None:
        await self._httpx.aclose()


def _refused_stream(exc: httpx.TransportError) -> bool:
    """RST_STREAM(REFUSED_STREAM): the server did not process the request (RFC 9113 8.7)."""
    event = exc.__cause__.args[0] if exc.__cause__ is not None and exc.__cause__.args else None
    return isinstance(event, h2.events.StreamReset) and event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
