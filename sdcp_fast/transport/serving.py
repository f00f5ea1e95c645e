"""What every connection of one server shares, below both protocol adapters.

`server.py` builds one `Serving` per server and hands it to the HTTP/2 adapter
(`server_h2.py`) and the HTTP/3 adapter (`server_h3.py`); neither adapter knows `Server`.
Besides the handler and TLS, it holds the limits (limits.py), the refusal counter
(refusals.py), the certificate policy (certpolicy.py) and the books the connection caps
are kept by: handshakes in progress, live connections per client identity, and the
clients that were told to calm down.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from .certpolicy import CertificatePolicy
from .exchange import RequestHeads
from .http import Handler, handler_entry
from .limits import Limits
from .refusals import Kind, Refusals
from .tlsconfig import TLSConfig


class Serving:
    """The handler, the limits, TLS, the live connections and the tasks of one server."""

    def __init__(self, handler: Handler, *, tls: TLSConfig, limits: Limits | None = None,
                 refusals: Refusals | None = None):
        self.handler = handler
        self.handle = handler_entry(handler)   # what a request is awaited on
        self.tls = tls
        self.limits = limits or Limits()
        self.refusals = refusals or Refusals()
        self.ssl_context = tls.server_ssl_context()
        self.certificates = CertificatePolicy(tls.ca)
        self.connections: set[Any] = set()        # live H2ServerProtocol / H3ServerProtocol
        self.per_client: Counter[str] = Counter()  # live connections per identity
        self.handshakes: OrderedDict[Any, Callable[[], None]] = OrderedDict()  # oldest first -> abort
        self.penalties: dict[str, float] = {}      # identity -> monotonic time its penalty ends
        self._arrivals: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host -> (tokens, when)
        self._resource_of = getattr(handler, "resource_of", None)
        self.request_heads = RequestHeads(self.limits.max_header_list, self.body_limit)
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- requests ------------------------------------------------------------------------
    def body_limit(self, method: str, path: str) -> int:
        """The body limit of the resource a request goes to (before any body byte is kept)."""
        resource = self._resource_of(method, path) if self._resource_of is not None else None
        return self.limits.body_limit(resource)

    # ---- connection books ----------------------------------------------------------------
    def may_connect(self, host: str) -> bool:
        """A token bucket per host: `new_connections_burst` at once, then
        `new_connections_per_host_s` a second. Refusing before the TLS handshake is what
        keeps a client that reconnects in a loop (after ENHANCE_YOUR_CALM, say) from making
        the server spend a handshake's CPU on it each time."""
        limits, now = self.limits, time.monotonic()
        tokens, then = self._arrivals.pop(host, (float(limits.new_connections_burst), now))
        tokens = min(float(limits.new_connections_burst), tokens + (now - then) * limits.new_connections_per_host_s)
        allowed = tokens >= 1.0
        self._arrivals[host] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._arrivals) > 65536:   # bounded: the least recently seen hosts go first
            self._arrivals.popitem(last=False)
        return allowed


    def handshake_started(self, key: Any, abort: Callable[[], None], peer: object) -> None:
        """Track one handshake; over `max_handshakes`, the oldest one is dropped to make room
        (a client that completes its handshake in milliseconds never loses its place to
        connections that sit idle)."""
        self.handshakes[key] = abort
        while len(self.handshakes) > self.limits.max_handshakes:
            _, oldest_abort = self.handshakes.popitem(last=False)
            self.refusals.refuse(Kind.HANDSHAKE_DROPPED, peer,
                                 f"over max_handshakes={self.limits.max_handshakes}: the oldest dropped")
            oldest_abort()

    def handshake_ended(self, key: Any) -> None:
        self.handshakes.pop(key, None)

    def admit(self, connection: Any, caller: str) -> tuple[str, str] | None:
        """Count an authenticated connection in, or say why not: (refusal kind, detail)."""
        until = self.penalties.get(caller)
        if until is not None:
            if time.monotonic() < until:
                return Kind.CALM_PENALTY, "told to calm down; retry later"
            del self.penalties[caller]
        if len(self.connections) >= self.limits.max_connections:
            return Kind.CONNECTIONS, f"server at max_connections={self.limits.max_connections}"
        if self.per_client[caller] >= self.limits.max_connections_per_client:
            return Kind.CLIENT_CONNECTIONS, \
                f"client at max_connections_per_client={self.limits.max_connections_per_client}"
        self.connections.add(connection)
        self.per_client[caller] += 1
        return None

    def release(self, connection: Any, caller: str | None) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            if caller is not None:
                self.per_client[caller] -= 1
                if self.per_client[caller] <= 0:
                    del self.per_client[caller]

    def calm_down(self, caller: str | None) -> None:
        """`caller` broke a per-connection budget: refuse its connections for a while."""
        if caller is not None and self.limits.calm_penalty_s > 0:
            self.penalties[caller] = time.monotonic() + self.limits.calm_penalty_s
            if len(self.penalties) > 4096:  # bounded: forget the expired ones
                now = time.monotonic()
                self.penalties = {k: v for k, v in self.penalties.items() if v > now}

    # ---- tasks ---------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[Any]:
        """Tasks are kept referenced (asyncio holds only weak references) and cancelled on stop.
        `loop`: the running loop where the caller has it (asking for it is a getpid() system
        call on Python 3.11)."""
        task = (loop or asyncio.get_running_loop()).create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self, grace: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
