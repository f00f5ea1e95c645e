"""One request lifecycle for the HTTP/2 and HTTP/3 servers.

A connection's requests go through the same steps whatever the protocol: a header block is
checked (`RequestHeads`: malformed -> a stream error, 431/400/413/415 -> an answer from the
transport), a body is awaited under `body_timeout` (408), the handler runs under
`handler_timeout` (503), its answer is written, and misbehaviour is counted against the
connection's two budgets (strikes.py: early resets, refused requests; past one the
connection ends "calm down" and the caller is penalised). `RequestLifecycle` holds that
state and those decisions once; a protocol adapter (server_h2.py, server_h3.py) feeds it
what its library reports and provides the five wire operations below, each of which must
tolerate a stream or connection that ended meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import Problem

from .exchange import IncomingRequest, Malformed, PendingBodies, respond_to
from .http import Request, Response, body_timeout_response, problem_response
from .refusals import Kind, log
from .serving import Serving
from .strikes import REFUSED_STATUSES, ConnectionStrikes

_REFUSAL_KINDS = {413: Kind.BODY_TOO_LARGE, 415: Kind.MEDIA_TYPE, 431: Kind.HEADERS_TOO_LARGE}


class RequestLifecycle:
    """The requests of one admitted connection, from header block to answer."""

    PROTOCOL = "?"   # "h2" | "h3": the prefix of every log line

    def __init__(self, serving: Serving):
        self._serving = serving
        self._limits = serving.limits
        self.caller: str | None = None
        self._pending = PendingBodies(self._limits.body_timeout, self._body_overdue)
        self._tasks: dict[int, asyncio.Task[None]] = {}   # streams being answered
        self._strikes = ConnectionStrikes(self._limits)
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._handler_limits = Deadlines(self._loop)   # the handler time limit of each request

    # ---- the wire operations an adapter provides -----------------------------------------
    def _write_answer(self, stream_id: int, response: Response, head: bool) -> Awaitable[None] | None:
        """Send `response` (no content for HEAD) and end our side of the stream; what must
        still be awaited for it (content waiting for flow-control credit), if anything."""
        raise NotImplementedError

    def _reset_malformed(self, stream_id: int) -> None:
        """A stream error for a malformed request (PROTOCOL_ERROR / H3_MESSAGE_ERROR)."""
        raise NotImplementedError

    def _reject_unprocessed(self, stream_id: int) -> None:
        """Refuse a request that arrived while closing, as safe to retry elsewhere."""
        raise NotImplementedError

    def _stop_upload(self, stream_id: int, overdue: bool) -> None:
        """The answer was sent before the request's body ended: stop or drain the rest
        (`overdue`: the body took longer than body_timeout)."""
        raise NotImplementedError

    def _end_connection(self, kind: str) -> None:
        """End the connection at once: "calm" (the client misbehaved) or "done"."""
        raise NotImplementedError

    # ---- the steps -----------------------------------------------------------------------
    @property
    def _client(self) -> object:
        return self.caller or self._peer

    @property
    def busy(self) -> bool:
        """Answers still to send (a graceful stop waits for these)."""
        return bool(self._tasks or self._pending)

    def _owed(self, stream_id: int) -> bool:
        return stream_id in self._tasks or self._pending.get(stream_id) is not None

    def _on_headers(self, stream_id: int, headers, ended: bool, body: bytes | None = None) -> None:
        """A request's header block; `ended`: no body follows; `body`: its whole body, known
        with the headers (None: it may still arrive)."""
        if self._closing:
            self._reject_unprocessed(stream_id)
            return
        incoming = self._serving.request_heads.incoming(headers)
        if isinstance(incoming, Malformed):
            self._reset_malformed(stream_id)
            self._stream_refused(stream_id, Kind.MALFORMED, incoming.reason)
        elif isinstance(incoming, Problem):
            self._refuse(stream_id, incoming, request_complete=ended or body is not None)
        elif ended:
            self._start(stream_id, incoming)
        elif body is not None:
            self._pending.add(stream_id, incoming)
            self._on_body(stream_id, body, True)
        else:
            self._pending.add(stream_id, incoming)

    def _on_body(self, stream_id: int, data: bytes, ended: bool) -> None:
        """Body bytes of a pending request (any other stream's are dropped)."""
        incoming = self._pending.get(stream_id)
        if incoming is None:
            return
        refusal = incoming.add_body(data) if data else None
        if refusal is not None:
            self._refuse(stream_id, refusal, request_complete=ended)
        elif ended:
            self._pending.take(stream_id)
            self._start(stream_id, incoming)

    def _on_reset(self, stream_id: int) -> bool:
        """The client cancelled a stream. Before its answer that counts towards the
        rapid-reset budget: opening and resetting streams costs the client nothing and the
        server a request each. True when an answer was owed."""
        owed = self._owed(stream_id)
        self._drop_stream(stream_id)
        if owed:
            self._count_early_reset(stream_id, "reset by the client before its answer")
        return owed

    def _drop_stream(self, stream_id: int) -> None:
        self._pending.take(stream_id)
        task = self._tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()

    def _stream_refused(self, stream_id: int, kind: str, detail: str) -> None:
        """A stream ended by a stream error of ours: logged, and an early reset."""
        self._serving.refusals.refuse(kind, self._client, f"{self.PROTOCOL}: stream {stream_id}: {detail}")
        self._count_early_reset(stream_id, detail)

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport, before the handler; the rest of an upload is stopped."""
        self._pending.take(stream_id)
        kind = _REFUSAL_KINDS.get(problem.status)
        if kind is not None:
            self._serving.refusals.refuse(
                kind, self._client, f"{self.PROTOCOL}: stream {stream_id} -> {problem.status} {problem.detail}")
        else:
            log.info("%s: stream %d from %s -> %d %s", self.PROTOCOL, stream_id, self.caller,
                     problem.status, problem.detail)
        self._write_now(stream_id, problem_response(problem))
        if not request_complete:
            self._stop_upload(stream_id, False)
        self._count_refused(stream_id, problem.status)

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: 408, upload stopped."""
        self._serving.refusals.refuse(Kind.BODY_TIMEOUT, self._client,
                                      f"{self.PROTOCOL}: stream {stream_id} -> 408: body not complete within "
                                      f"{self._limits.body_timeout}s")
        self._write_now(stream_id, body_timeout_response(self._limits.body_timeout))
        self._stop_upload(stream_id, True)

    def _write_now(self, stream_id: int, response: Response) -> None:
        """An answer of the transport's own (small: it fits the first window as a rule)."""
        rest = self._write_answer(stream_id, response, False)
        if rest is not None:
            self._serving.spawn(rest, self._loop)

    def _start(self, stream_id: int, incoming: IncomingRequest) -> None:
        """The request is whole: run the handler (a body that breaks its content-length is
        a malformed request instead)."""
        mismatch = incoming.length_mismatch()
        if mismatch is not None:
            self._reset_malformed(stream_id)
            self._stream_refused(stream_id, Kind.MALFORMED, mismatch)
            return
        request = incoming.finish(self.caller)
        self._tasks[stream_id] = self._serving.spawn(self._answer(stream_id, request, incoming.head), self._loop)

    async def _answer(self, stream_id: int, request: Request, head: bool) -> None:
        task = asyncio.current_task(self._loop)
        try:
            timeout = self._limits.handler_timeout
            response = await respond_to(self._serving.handler, request,
                                        self._handler_limits.timeout(task, timeout), timeout)
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
        over = self._strikes.early_reset(self._loop.time(), stream_id, detail)
        if over is not None:
            self._calm_down(*over)

    def _count_refused(self, stream_id: int, status: int) -> None:
        """A request answered 400/413/415/431 (any other status counts nothing, and reads no
        clock). Called from the stream's own task too, which ending the connection cancels:
        so that runs as a callback."""
        if status not in REFUSED_STATUSES:
            return
        over = self._strikes.refused(self._loop.time(), stream_id, status)
        if over is not None:
            self._loop.call_soon(self._calm_down, *over)

    def _calm_down(self, kind: str, detail: str) -> None:
        """End the connection (ENHANCE_YOUR_CALM / H3_EXCESSIVE_LOAD, the kind as its
        reason) and refuse the client for `calm_penalty_s`."""
        if self._calm_reason:
            return
        self._serving.refusals.refuse(kind, self._client, f"{self.PROTOCOL}: {detail}")
        self._serving.calm_down(self.caller)
        self._closing = True
        for stream_id in list(self._tasks):
            self._drop_stream(stream_id)
        self._pending.clear()
        self._calm_reason = kind
        self._end_connection("calm")

    _calm_reason = ""

    def goaway(self) -> None:
        """Graceful close: refuse new requests (safe to retry), answer the ones in flight, then
        end the connection."""
        self._closing = True
        if not self._tasks:
            self._end_connection("done")

    def _forget_requests(self) -> None:
        """The connection is gone: nothing is owed any more."""
        for task in self._tasks.values():
            task.cancel()
        self._pending.clear()
        self._handler_limits.close()
