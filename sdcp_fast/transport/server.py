"""`serve()`: one handler on HTTP/2 (TLS 1.3/TCP) and HTTP/3 (QUIC/UDP) at one host and port.
The one place that picks the protocol adapters; the HTTP/3 one is imported only when HTTP/3
is served (aioquic is an optional extra)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import Any

from .http import Handler, log
from .lifecycle import Serving
from .limits import Limits
from .listener_h2 import TCPListener
from .refusals import Refusals
from .server_h2 import H2ServerProtocol
from .tlsconfig import TLSConfig


class Server:
    """Started by `serve()`; `port` is the bound port (useful with port=0); `await stop()`."""

    def __init__(self, handler: Handler, *, host: str, port: int, tls: TLSConfig, http2: bool = True,
                 http3: bool = True, limits: Limits | None = None, refusals: Refusals | None = None,
                 **overrides: Any):
        if not (http2 or http3):
            raise ValueError("enable http2, http3 or both")
        limits = dataclasses.replace(limits or Limits(), **overrides)
        self.serving = Serving(handler, tls=tls, limits=limits, refusals=refusals)
        self.host = host
        self.tls = tls
        self.http2 = http2
        self.http3 = http3
        self._requested_port = port
        self._port: int | None = None
        self._tcp: TCPListener | None = None
        self._quic: Any = None  # server_h3.H3Listener

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def connections(self) -> set[Any]:
        """Live (authenticated) HTTP/2 and HTTP/3 connections."""
        return self.serving.connections

    @property
    def refusals(self) -> Refusals:
        return self.serving.refusals

    async def start(self) -> None:
        # With port 0, the TCP port is chosen first and UDP must get the same number; retry if taken.
        for _attempt in range(20):
            try:
                await self._bind(self._requested_port)
                break
            except OSError:
                await self._close_listeners()
                if self._requested_port != 0:
                    raise
        else:
            raise OSError("no port free for both TCP and UDP")
        log.info("serving %s on %s port %d (%s)",
                 "+".join(p for p, on in (("h2", self.http2), ("h3", self.http3)) if on),
                 self.host, self.port, self.serving.limits)

    async def _bind(self, port: int) -> None:
        if self.http2:
            listening = socket.create_server((self.host, port), family=_family(self.host),
                                             backlog=max(256, self.serving.limits.max_handshakes))
            self._tcp = TCPListener(self.serving, listening, H2ServerProtocol)
            port = listening.getsockname()[1]
        if self.http3:
            from .server_h3 import H3Listener  # the optional h3 extra

            if port == 0:  # HTTP/3 only: let UDP choose
                port = _free_udp_port(self.host)
            limits = self.serving.limits
            configuration = self.tls.quic_configuration(is_client=False, idle_timeout=limits.idle_timeout)
            configuration.max_data = limits.quic_max_data
            configuration.max_stream_data = limits.quic_max_stream_data
            # No session-ticket store: resumption would skip the client certificate.
            _, self._quic = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: H3Listener(configuration, self.serving), local_addr=(self.host, port))
        self._port = port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `grace` seconds; close all."""
        if self._tcp is not None:
            self._tcp.close()
        for connection in list(self.connections):
            connection.goaway()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            connection.abort()
        await asyncio.sleep(0)  # let aioquic send its CONNECTION_CLOSE frames
        await self._close_listeners()
        await self.serving.cancel_tasks(grace)
        log.info("stopped serving on port %s", self._port)

    async def _close_listeners(self) -> None:
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
            self._tcp = None
        if self._quic is not None:
            self._quic.close()
            self._quic = None

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def serve(handler: Handler, **options: Any) -> Server:
    """Start serving `handler`: `Server`'s options (host, port, tls, http2, http3, `limits`
    with single members overridden by keyword, e.g. `max_body=4096`, and `refusals`)."""
    server = Server(handler, **options)
    await server.start()
    return server


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _free_udp_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
