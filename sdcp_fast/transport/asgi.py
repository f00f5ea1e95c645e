"""Plain HTTP endpoints (the router's front door, the verifier's metrics page) served by
hypercorn as ASGI apps. SDCP itself is served by `server.py` (our HTTP/2 + HTTP/3 with
mutual TLS); this adapter is for clients and scrapers.

    server = await serve_web(handler, host="127.0.0.1", port=0, tls=None | TLSConfig)
    server.port; await server.stop()

`WebRequest`: the whole body, at most `max_body` bytes (413), read within `read_timeout_s`
(408). A `StreamingResponse` sends its chunks as they come and stops when the client goes
away; a handler still working then is cancelled; an exception out of it is a logged 500.
With `tls`, clients must present a certificate from `tls.ca` (the handler learns no identity).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qsl

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from .tlsconfig import TLSConfig

log = logging.getLogger("sdcp_fast.transport.web")
DEFAULT_MAX_BODY = 1 << 20
DEFAULT_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WebRequest:
    method: str
    path: str
    query: dict[str, str]       # decoded; the last value wins for repeated names
    headers: dict[str, str]     # lower-case names; the last value wins
    body: bytes


@dataclass(frozen=True)
class WebResponse:
    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, obj: Any) -> WebResponse:
        return cls(status, json.dumps(obj, separators=(",", ":")).encode())


@dataclass(frozen=True)
class StreamingResponse:
    status: int
    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"
    headers: tuple[tuple[str, str], ...] = (("cache-control", "no-store"),)


class WebHandler(Protocol):
    async def handle(self, request: WebRequest) -> WebResponse | StreamingResponse: ...


class _TooLarge(Exception):
    pass


class WebApp:
    """The ASGI application around one WebHandler."""

    def __init__(self, handler: WebHandler, *, max_body: int = DEFAULT_MAX_BODY,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.handler = handler
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.read_timeout_s)
        except _TooLarge:
            await _send(send, WebResponse.json(413, {"error": "body too large"}))
            return
        except TimeoutError:
            await _send(send, WebResponse.json(408, {"error": "request body not received in time"}))
            return
        if body is None:   # the client went away
            return
        request = WebRequest(
            method=scope["method"], path=scope["path"],
            query=dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)),
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])},
            body=body)
        # a client that goes away before the answer cancels the handler
        handling = await _until_gone(self.handler.handle(request), receive)
        if handling.cancelled():
            return
        try:
            response = handling.result()
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            await _send(send, WebResponse.json(500, {"error": "internal error"}))
            return
        if isinstance(response, StreamingResponse):
            await _stream(response, receive, send)
        else:
            await _send(send, response)

    async def _read_body(self, receive) -> bytes | None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                raise _TooLarge
            if not message.get("more_body", False):
                return bytes(body)


def _headers(content_type: str | None, extra: tuple[tuple[str, str], ...]) -> list[tuple[bytes, bytes]]:
    headers = [] if content_type is None else [(b"content-type", content_type.encode())]
    return headers + [(k.lower().encode(), v.encode()) for k, v in extra]


async def _send(send, response: WebResponse) -> None:
    headers = _headers(response.content_type, response.headers)
    headers.append((b"content-length", str(len(response.body)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


async def _stream(response: StreamingResponse, receive, send) -> None:
    """Send chunks as they come; stop (and close the iterator) once the client is gone."""
    await send({"type": "http.response.start", "status": response.status,
                "headers": _headers(response.content_type, response.headers)})

    async def pump() -> None:
        async for chunk in response.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    try:
        pumping = await _until_gone(pump(), receive)
    finally:
        aclose = getattr(response.chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
    if not pumping.cancelled() and pumping.exception() is not None:
        log.warning("stream ended by an error: %s", pumping.exception())


async def _until_gone(work, receive) -> asyncio.Task:
    """`work` as a task, cancelled if the client disconnects first; the task, once it is done."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watching = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for running in (task, watching):
            running.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(task, watching, return_exceptions=True)
    return task


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class _Config(Config):
    """hypercorn's TLS context, raised to TLS 1.3 (as the SDCP endpoints)."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        context = super().create_ssl_context()
        if context is not None:
            context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context


@dataclass
class WebServer:
    """A running `serve_web`: `port` is the bound port; `await stop()` ends it."""

    port: int
    _task: asyncio.Task
    _shutdown: asyncio.Event

    async def stop(self, grace: float = 2.0) -> None:
        self._shutdown.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, grace + 1.0)


async def serve_web(handler: WebHandler, *, host: str, port: int, tls: TLSConfig | None = None,
                    max_body: int = DEFAULT_MAX_BODY, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                    grace: float = 2.0) -> WebServer:
    """Serve `handler` over HTTP/1.1 (and HTTP/2 with TLS) at host:port (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)            # connections queue from here on, before hypercorn starts
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    config = _Config()
    config.bind = [f"fd://{sock.detach()}"]   # hypercorn owns the socket from here on
    config.graceful_timeout = grace
    config.keep_alive_max_requests = 1 << 62
    config.accesslog = None
    config.errorlog = log
    config.include_server_header = False
    if tls is not None:
        config.certfile, config.keyfile, config.ca_certs = str(tls.cert), str(tls.key), str(tls.ca)
        config.verify_mode = ssl.CERT_REQUIRED
    shutdown = asyncio.Event()
    app = WebApp(handler, max_body=max_body, read_timeout_s=read_timeout_s)
    task = asyncio.get_running_loop().create_task(
        hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, mode="asgi"), name=f"web:{bound}")
    await asyncio.sleep(0)
    if task.done():
        task.result()   # hypercorn could not start: say why
    return WebServer(bound, task, shutdown)
