"""HTTP/2 client adapter on httpx (mutual TLS 1.3): connections kept per origin and reused,
requests on one connection as concurrent streams.

A pool whose stream accounting drifted is replaced. httpcore 1.0.x releases its own stream
slot when a request is cancelled or times out before its END_STREAM went out, but never
resets the stream in h2, which goes on counting it open (encode/httpcore#1022, #943; the fix
proposed in #1098 is not released): under load every such timeout leaks one of the server's
SETTINGS_MAX_CONCURRENT_STREAMS, until each request fails with "Max outbound streams is N,
N open" (or a "semaphore released too many times"), while the server sits idle; seen in the
256-client soak (bench/RESULTS.md). On either error the origin gets a fresh httpx client; the
old one is closed once the requests still on it had their time (`timeout`).
"""

from __future__ import annotations

import asyncio
import logging

import h2.errors
import h2.events
import httpx

from .client_base import ClientResponse, RequestTimeout, TransportError
from .tlsconfig import TLSConfig

log = logging.getLogger("sdcp_fast.transport")
# what httpcore's drifted stream accounting (module docstring) raises
DRIFT_SIGNS = ("Max outbound streams", "semaphore released too many times")


class H2Origins:
    def __init__(self, tls: TLSConfig, *, timeout: float, connect_timeout: float, idle_timeout: float,
                 max_response: int):
        self._connect_timeout = connect_timeout
        self._max_response = max_response
        self._timeout = timeout
        self._make = lambda: httpx.AsyncClient(
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
        self._httpx = self._make()
        self._retiring: dict[asyncio.Task, httpx.AsyncClient] = {}   # replaced clients, closing later

    async def open(self, url: str) -> str:
        """httpx connects inside `send`: nothing to open first."""
        return url

    async def send(self, url: str, method: str, body: bytes | None, content_type: str | None,
                   limit: float) -> ClientResponse:
        headers = {"content-type": content_type} if body is not None and content_type else {}
        client = self._httpx
        try:
            request = client.build_request(method, url, content=body, headers=headers,
                                           timeout=httpx.Timeout(limit, connect=self._connect_timeout))
            response = await client.send(request, stream=True)
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
            if any(sign in str(exc) for sign in DRIFT_SIGNS):
                self._replace(client, exc)
                raise TransportError(f"{type(exc).__name__} on {method} {url}: {exc}", sent=False) from exc
            raise TransportError(f"{type(exc).__name__} on {method} {url}: {exc}",
                                 sent=not _refused_stream(exc)) from exc
        except ValueError as exc:   # anyio's semaphore, from httpcore's release of a stream slot
            if not any(sign in str(exc) for sign in DRIFT_SIGNS):
                raise
            self._replace(client, exc)
            raise TransportError(f"{method} {url}: the HTTP/2 pool's stream accounting drifted ({exc})",
                                 sent=True) from exc
        return ClientResponse(response.status_code, {k.lower(): v for k, v in response.headers.items()},
                              bytes(data))

    def _replace(self, client: httpx.AsyncClient, exc: Exception) -> None:
        """A fresh client for what comes next; `client` closes once its requests had their time."""
        if client is not self._httpx:
            return                           # replaced already by a request that saw it first
        log.warning("h2 client: stream accounting drifted (%s): new connections from here on", exc)
        self._httpx = self._make()
        task = asyncio.get_running_loop().create_task(self._close_later(client))
        self._retiring[task] = client
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def _close_later(self, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(self._timeout)
        await client.aclose()

    async def aclose(self) -> None:
        for task, client in list(self._retiring.items()):
            task.cancel()
            await client.aclose()
        await self._httpx.aclose()


def _refused_stream(exc: httpx.TransportError) -> bool:
    """RST_STREAM(REFUSED_STREAM): the server did not process the request (RFC 9113 8.7)."""
    event = exc.__cause__.args[0] if exc.__cause__ is not None and exc.__cause__.args else None
    return isinstance(event, h2.events.StreamReset) and event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
