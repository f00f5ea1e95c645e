"""What one server's connections share (`Serving`), and one request lifecycle for the HTTP/2
and HTTP/3 servers (`RequestLifecycle`): the caller named by its certificate and admitted by
the connection caps; a header block checked (malformed: a stream error; 431/400/413/415:
answered by the transport); the body awaited under `body_timeout` (408); the handler run
under `handler_timeout` (503) and its answer written; misbehaviour counted against the
connection's two budgets (`Strikes`), past either of which the connection ends and the
caller is refused for `calm_penalty_s`. An adapter feeds in what its library reports and
provides the wire operations, each tolerating a stream or connection that ended meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import Kind as ProblemKind
from sdcp_fast.core.problems import Problem

from .certpolicy import CertificatePolicy, CertificateRejected
from .exchange import IncomingRequest, Malformed, RequestHeads
from .http import (
    Handler,
    Request,
    Response,
    body_timeout_response,
    failure_response,
    handler_entry,
    problem_response,
)
from .limits import Limits
from .refusals import Kind, Refusals, log
from .tlsconfig import TLSConfig


class Serving:
    """The handler, the limits, TLS, the live connections and the tasks of one server."""

    def __init__(self, handler: Handler, *, tls: TLSConfig, limits: Limits | None = None,
                 refusals: Refusals | None = None):
        self.handle = handler_entry(handler)   # what a request is awaited on
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
        """A token bucket per host (`new_connections_burst`, then `new_connections_per_host_s`),
        checked before the TLS handshake: a client reconnecting in a loop costs no handshakes."""
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
        """A task kept referenced and cancelled on stop; `loop`: the running loop, if known."""
        task = (loop or asyncio.get_running_loop()).create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self, grace: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)


# answers that say the request itself was bad (a well-behaved client does not send them),
# with the refusal kind each is counted as (400: logged only)
REFUSED_STATUSES = {400: None, 413: Kind.BODY_TOO_LARGE, 415: Kind.MEDIA_TYPE, 431: Kind.HEADERS_TOO_LARGE}


@dataclass
class Strikes:
    """Strikes within a fixed window that starts at the first strike after the last one ended."""

    limit: int
    window_s: float
    start: float = 0.0
    count: int = 0

    def add(self, now: float) -> bool:
        """Count one strike at `now`; True when it is one over the limit (the connection ends)."""
        if now - self.start > self.window_s:
            self.start, self.count = now, 0
        self.count += 1
        return self.count == self.limit + 1


class RequestLifecycle:
    """The requests of one admitted connection, from header block to answer."""

    PROTOCOL = "?"   # "h2" | "h3": the prefix of every log line
    MALFORMED: int    # the stream error code of a malformed request (PROTOCOL_ERROR / H3_MESSAGE_ERROR)
    UNPROCESSED: int  # refusing a request while closing, safe to retry (REFUSED_STREAM / H3_REQUEST_REJECTED)

    def __init__(self, serving: Serving):
        self._serving = serving
        self._limits = serving.limits
        self.caller: str | None = None
        self._peer: object = None
        self._admitted = False
        self._pending: dict[int, IncomingRequest] = {}   # requests whose body is still arriving
        self._tasks: dict[int, asyncio.Task[None]] = {}   # streams being answered
        self._reset_budget = Strikes(self._limits.max_early_resets, self._limits.early_reset_window_s)
        self._refusal_budget = Strikes(self._limits.max_refused_requests, self._limits.early_reset_window_s)
        self._closing = False
        self._calm_reason = ""   # the refusal kind that ended the connection, once one did
        self._rejected: CertificateRejected | None = None   # set by _admit
        self._refusal = ""   # the detail of a refused admission
        self._loop = asyncio.get_running_loop()
        self._handler_limits = Deadlines(self._loop)   # the handler time limit of each request

    # ---- the wire operations an adapter provides (and `_reset(stream_id, code)`, which ends
    # a stream with MALFORMED, UNPROCESSED or a code of the protocol's own) ----------------
    def _write_answer(self, stream_id: int, response: Response, head: bool) -> Awaitable[None] | None:
        """Send `response` (no content for HEAD) and end our side of the stream; what must
        still be awaited for it (content waiting for flow-control credit), if anything."""
        raise NotImplementedError

    def _stop_upload(self, stream_id: int, overdue: bool) -> None:
        """The answer was sent before the request's body ended: stop or drain the rest
        (`overdue`: the body took longer than body_timeout)."""
        raise NotImplementedError

    def _end_connection(self, kind: str) -> None:
        """End the connection at once: "calm" (the client misbehaved) or "done"."""
        raise NotImplementedError

    def _send_answers(self) -> None:
        """An answer was queued: sent now (the adapter's `transmit`) when it is the only stream
        in flight, else with the batch's other answers at the end of this turn (`transmit_soon`)."""
        if len(self._tasks) <= 1:
            self.transmit()
        else:
            self.transmit_soon()

    # ---- admission -----------------------------------------------------------------------
    def _admit(self, certificate, check) -> str | None:
        """Name the caller (`check(certificate)`) and count the connection in: None, or the
        refusal's kind (counted and logged), its detail in `_refusal`, a refused certificate's
        CertificateRejected in `_rejected`."""
        try:
            if not certificate:
                raise CertificateRejected(CertificateRejected.MISSING, "no client certificate")
            self.caller = check(certificate)
        except CertificateRejected as exc:
            self._rejected = exc
            self._count_refusal(Kind.CERTIFICATE, f"refused client {self._peer}: {exc}")
            return Kind.CERTIFICATE
        refusal = self._serving.admit(self, self.caller)
        if refusal is not None:
            kind, self._refusal = refusal
            self._count_refusal(kind, self._refusal)
            return kind
        self._admitted = True
        log.debug("%s: connection from %s as %s", self.PROTOCOL, self._peer, self.caller)
        return None

    def _connection_over(self) -> None:
        """The connection is gone: it no longer counts, and nothing is owed any more."""
        if self._admitted:
            self._serving.release(self, self.caller)
        for stream_id in [*self._tasks, *self._pending]:
            self._drop_stream(stream_id)
        self._handler_limits.close()

    # ---- the steps -----------------------------------------------------------------------
    @property
    def _client(self) -> object:
        return self.caller or self._peer

    def _count_refusal(self, kind: str, detail: str) -> None:
        """A refusal counted against the caller (its address before it is known)."""
        self._serving.refusals.refuse(kind, self._client, f"{self.PROTOCOL}: {detail}")

    @property
    def busy(self) -> bool:
        """Answers still to send (a graceful stop waits for these)."""
        return bool(self._tasks or self._pending)

    def _on_headers(self, stream_id: int, headers, ended: bool, body: bytes | None = None) -> None:
        """A request's header block; `ended`: no body follows; `body`: its whole body, known
        with the headers (None: it may still arrive)."""
        if self._closing:
            self._reset(stream_id, self.UNPROCESSED)
            return
        incoming = self._serving.request_heads.head(headers)
        if isinstance(incoming, Malformed):
            self._reset(stream_id, self.MALFORMED)
            self._stream_refused(stream_id, Kind.MALFORMED, incoming.reason)
        elif isinstance(incoming, Problem):
            self._refuse(stream_id, incoming, request_complete=ended or body is not None)
        elif body is not None or ended:   # the request is whole: nothing to await
            problem = None if body is None else incoming.too_large(len(body))
            if problem is not None:
                self._refuse(stream_id, problem, request_complete=True)
            else:
                self._start(stream_id, incoming, b"" if body is None else body)
        else:   # a request of its own (the head is shared): its body, its deadline
            self._pending[stream_id] = dataclasses.replace(incoming, body=bytearray(), deadline=self._loop.call_later(
                self._limits.body_timeout, self._body_overdue, stream_id))

    def _on_body(self, stream_id: int, data: bytes, ended: bool) -> None:
        """Body bytes of a pending request (any other stream's are dropped)."""
        incoming = self._pending.get(stream_id)
        if incoming is None:
            return
        refusal = incoming.add_body(data) if data else None
        if refusal is not None:
            self._refuse(stream_id, refusal, request_complete=ended)
        elif ended:
            self._take_pending(stream_id)
            self._start(stream_id, incoming, incoming.body)

    def _on_reset(self, stream_id: int) -> bool:
        """The client cancelled a stream. Before its answer that counts towards the
        rapid-reset budget: opening and resetting streams costs the client nothing and the
        server a request each. True when an answer was owed."""
        owed = self._drop_stream(stream_id)
        if owed:
            self._count_early_reset(stream_id, "reset by the client before its answer")
        return owed

    def _drop_stream(self, stream_id: int) -> bool:
        """Nothing more for the stream: its body not awaited, its answer cancelled; True
        when an answer was owed."""
        task = self._tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()
        return self._take_pending(stream_id) or task is not None

    def _stream_refused(self, stream_id: int, kind: str, detail: str) -> None:
        """A stream ended by a stream error of ours: logged, and an early reset."""
        self._count_refusal(kind, f"stream {stream_id}: {detail}")
        self._count_early_reset(stream_id, detail)

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport, before the handler; the rest of an upload is stopped."""
        self._take_pending(stream_id)
        kind = REFUSED_STATUSES.get(problem.status)
        if kind is not None:
            self._count_refusal(kind, f"stream {stream_id} -> {problem.status} {problem.detail}")
        else:
            log.info("%s: stream %d from %s -> %d %s", self.PROTOCOL, stream_id, self.caller,
                     problem.status, problem.detail)
        self._write_now(stream_id, problem_response(problem))
        if not request_complete:
            self._stop_upload(stream_id, False)
        self._count_refused(stream_id, problem.status)

    def _take_pending(self, stream_id: int) -> bool:
        """The stream's body is no longer awaited: forget it and its deadline; False when
        none was."""
        incoming = self._pending.pop(stream_id, None)
        if incoming is not None:
            incoming.deadline.cancel()
        return incoming is not None

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: 408, upload stopped."""
        if not self._take_pending(stream_id):
            return
        self._count_refusal(Kind.BODY_TIMEOUT,
                            f"stream {stream_id} -> 408: body not complete within {self._limits.body_timeout}s")
        self._write_now(stream_id, body_timeout_response(self._limits.body_timeout))
        self._stop_upload(stream_id, True)

    def _write_now(self, stream_id: int, response: Response) -> None:
        """An answer of the transport's own (small: it fits the first window as a rule)."""
        rest = self._write_answer(stream_id, response, False)
        if rest is not None:
            self._serving.spawn(rest, self._loop)

    def _start(self, stream_id: int, incoming: IncomingRequest, body: bytes | bytearray) -> None:
        """The request is whole: run the handler (`incoming` may be a remembered head, left as
        it is: the request gets its own query), unless its body breaks the declared
        content-length (RFC 9113 8.1.1, RFC 9114 4.1.2): malformed, a stream error."""
        length = incoming.content_length
        if length is not None and not incoming.head and length != len(body):
            self._reset(stream_id, self.MALFORMED)
            self._stream_refused(stream_id, Kind.MALFORMED, f"content-length {length} but a body of {len(body)} bytes")
            return
        request = Request(incoming.method, incoming.path, dict(incoming.query) if incoming.query else {},
                          incoming.content_type, bytes(body), self.caller)
        self._tasks[stream_id] = self._serving.spawn(self._answer(stream_id, request, incoming.head), self._loop)

    async def _answer(self, stream_id: int, request: Request, head: bool) -> None:
        """The handler's answer within `handler_timeout`, in the stream's own task: a
        ProblemError becomes its document, any other exception a logged 500, the limit a 503."""
        task = asyncio.current_task(self._loop)
        timeout = self._limits.handler_timeout
        try:
            try:
                with self._handler_limits.timeout(task, timeout):
                    try:
                        response = await self._serving.handle(request)
                    except Exception as exc:
                        response = failure_response(request, exc)
            except TimeoutError:   # only the limit's: the handler's own are answered above
                log.warning("handler timed out after %ss on %s %s", timeout, request.method, request.path)
                response = problem_response(Problem(ProblemKind.UNAVAILABLE, "handler timed out"))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s from %s -> %d (%d bytes)", request.method, request.path, request.caller,
                          response.status, len(response.body))
            if self._tasks.get(stream_id) is task:   # not reset meanwhile
                rest = self._write_answer(stream_id, response, head)
                if rest is not None:
                    await rest
                self._count_refused(stream_id, response.status)
        finally:
            if self._tasks.get(stream_id) is task:
                del self._tasks[stream_id]
            self._answered()

    def _answered(self) -> None:
        """A request's task ended: a closing connection ends once the last is answered."""
        if self._closing and not self._tasks:
            self._end_connection("done")

    # ---- budgets and closing -------------------------------------------------------------
    def _count_early_reset(self, stream_id: int, detail: str) -> None:
        if self._reset_budget.add(self._loop.time()):
            self._calm_down(Kind.RAPID_RESET, (
                f"{self._reset_budget.count} streams reset or refused before their answer within "
                f"{self._reset_budget.window_s:g}s (last: stream {stream_id}, {detail})"))

    def _count_refused(self, stream_id: int, status: int) -> None:
        """A request answered 400/413/415/431 is a strike; ending the connection (which cancels
        the stream's task this may run in) runs as a callback."""
        if status in REFUSED_STATUSES and self._refusal_budget.add(self._loop.time()):
            self._loop.call_soon(self._calm_down, Kind.REFUSED_REQUESTS, (
                f"{self._refusal_budget.count} requests refused as malformed or over a limit within "
                f"{self._refusal_budget.window_s:g}s (last: stream {stream_id}, {status})"))

    def _calm_down(self, kind: str, detail: str) -> None:
        """End the connection (ENHANCE_YOUR_CALM / H3_EXCESSIVE_LOAD, the kind as its
        reason) and refuse the client for `calm_penalty_s`."""
        if self._calm_reason:
            return
        self._count_refusal(kind, detail)
        self._serving.calm_down(self.caller)
        self._closing = True
        for stream_id in [*self._tasks, *self._pending]:
            self._drop_stream(stream_id)
        self._calm_reason = kind
        self._end_connection("calm")

    def goaway(self) -> None:
        """Graceful close: refuse new requests (safe to retry), answer the ones in flight, then
        end the connection (HTTP/2: no GOAWAY before that; some clients fail open streams on one)."""
        self._closing = True
        self._answered()
