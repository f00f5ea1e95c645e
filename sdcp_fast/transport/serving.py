"""What every connection of one server shares, below both protocol adapters.

`server.py` builds one `Serving` per server and hands it to the HTTP/2 adapter
(`server_h2.py`) and the HTTP/3 adapter (`server_h3.py`); neither adapter knows `Server`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from .http import Handler
from .identity import ClientCertificateVerifier
from .tlsconfig import TLSConfig

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a proposal is a few hundred bytes, a session-open a prompt
DEFAULT_IDLE_TIMEOUT = 600.0  # long-lived drafter connections: close only after 10 idle minutes
# A request body must be complete this long after its headers: a stalled upload must not pin
# a connection and up to max_body of memory per stream forever (it is answered 408).
DEFAULT_BODY_TIMEOUT = 30.0


class Serving:
    """The handler, the limits, TLS, the live connections and the tasks of one server."""

    def __init__(
        self,
        handler: Handler,
        *,
        tls: TLSConfig,
        max_body: int = DEFAULT_MAX_BODY,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        handler_timeout: float | None = 60.0,
        handshake_timeout: float = 10.0,
        max_concurrent_streams: int = 256,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
    ):
        if max_body < 0:
            raise ValueError("max_body must be >= 0")
        if not body_timeout > 0:
            raise ValueError("body_timeout must be > 0")
        self.handler = handler
        self.tls = tls
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.handler_timeout = handler_timeout
        self.handshake_timeout = handshake_timeout
        self.max_concurrent_streams = max_concurrent_streams
        self.body_timeout = body_timeout
        self.ssl_context = tls.server_ssl_context()
        self.client_verifier = ClientCertificateVerifier(tls.ca)
        self.connections: set[Any] = set()  # live H2ServerProtocol / H3ServerProtocol
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Tasks are kept referenced (asyncio holds only weak references) and cancelled on stop."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self, grace: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
