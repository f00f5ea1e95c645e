"""HTTP/3 over QUIC on aioquic's QuicServer and H3Connection, with mandatory client certificates.

Every new QUIC connection gets `quic_mtls.require_client_certificate` before its first
datagram; HTTP/3 starts only after the handshake completed with a verified certificate whose
URI SAN becomes the caller of every request on the connection.
"""

from __future__ import annotations

import asyncio
import logging

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent, StreamReset

from sdcp_fast.core.problems import Problem

from .exchange import IncomingRequest, PendingBodies, respond_to, response_headers
from .http import Request, Response, body_timeout_response, problem_response
from .quic_mtls import rejection, require_client_certificate, verified_identity
from .serving import Serving

log = logging.getLogger("sdcp_fast.transport")
assert "h3" in H3_ALPN


class H3ServerProtocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, serving: Serving, **kwargs):
        require_client_certificate(quic, serving.client_verifier)
        super().__init__(quic, **kwargs)
        self._serving = serving
        self._h3: H3Connection | None = None
        self.caller: str | None = None
        self._pending = PendingBodies(serving.body_timeout, self._body_overdue)  # bodies arriving
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._closing = False

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.caller = verified_identity(self._quic)
            if self.caller is None:  # cannot happen with the hooks in place; refuse if it does
                log.error("h3: handshake completed without a verified client certificate")
                self._quic.close(error_code=ErrorCode.H3_INTERNAL_ERROR, reason_phrase="no identity")
                return
            self._h3 = H3Connection(self._quic)
            self._serving.connections.add(self)
            log.info("h3: connection from %s as %s", self._peer(), self.caller)
        elif isinstance(event, ConnectionTerminated):
            self._on_terminated(event)
        elif isinstance(event, StreamReset):
            self._pending.take(event.stream_id)
            task = self._tasks.pop(event.stream_id, None)
            if task is not None:
                task.cancel()
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._on_h3_event(h3_event)

    def _on_terminated(self, event: ConnectionTerminated) -> None:
        self._serving.connections.discard(self)
        for task in self._tasks.values():
            task.cancel()
        self._pending.clear()
        refused = rejection(self._quic)
        if self.caller is None:
            reason = refused or event.reason_phrase or f"error {event.error_code:#x}"
            log.info("h3: refused client %s: %s", self._peer(), reason)
        else:
            log.info("h3: connection from %s (%s) closed: %s", self._peer(), self.caller,
                     event.reason_phrase or f"code {event.error_code:#x}")

    def _on_h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if self._closing:
                self._quic.reset_stream(event.stream_id, ErrorCode.H3_REQUEST_REJECTED)
                self.transmit()
                return
            incoming = IncomingRequest.from_headers(event.headers, self._serving.max_body)
            if isinstance(incoming, Problem):
                self._refuse(event.stream_id, incoming, request_complete=event.stream_ended)
            elif event.stream_ended:
                self._start(event.stream_id, incoming)
            else:
                self._pending.add(event.stream_id, incoming)
        elif isinstance(event, DataReceived):
            incoming = self._pending.get(event.stream_id)
            if incoming is None:
                return  # a refused upload still draining, or a stream we never accepted
            refusal = incoming.add_body(event.data)
            if refusal is not None:
                self._refuse(event.stream_id, refusal, request_complete=event.stream_ended)
            elif event.stream_ended:
                self._pending.take(event.stream_id)
                self._start(event.stream_id, incoming)

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: STOP_SENDING, 408."""
        log.info("h3: stream %d from %s -> 408: body not complete within %ss",
                 stream_id, self.caller, self._serving.body_timeout)
        try:
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        except Exception as exc:  # the stream ended meanwhile
            log.debug("h3: could not stop stream %d: %s", stream_id, exc)
        self._write(stream_id, body_timeout_response(self._serving.body_timeout))

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport; stop the client's upload (RFC 9114 4.1.1: H3_NO_ERROR)."""
        self._pending.take(stream_id)
        log.info("h3: stream %d from %s -> %d %s", stream_id, self.caller, problem.status, problem.detail)
        if not request_complete:
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        self._write(stream_id, problem_response(problem))

    def _start(self, stream_id: int, incoming: IncomingRequest) -> None:
        self._tasks[stream_id] = self._serving.spawn(self._answer(stream_id, incoming.finish(self.caller)))

    async def _answer(self, stream_id: int, request: Request) -> None:
        try:
            response = await respond_to(self._serving.handler, request, self._serving.handler_timeout)
            if stream_id in self._tasks:  # not reset meanwhile
                self._write(stream_id, response)
        finally:
            self._tasks.pop(stream_id, None)
            if self._closing and not self._tasks:
                self._quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="server stopping")
                self.transmit()

    def _write(self, stream_id: int, response: Response) -> None:
        assert self._h3 is not None
        try:
            self._h3.send_headers(stream_id, response_headers(response), end_stream=not response.body)
            if response.body:
                # aioquic queues the bytes and paces them by QUIC flow control
                self._h3.send_data(stream_id, response.body, end_stream=True)
        except Exception as exc:  # stream already reset or connection closed: nothing to answer
            log.debug("h3: could not answer stream %d: %s", stream_id, exc)
        self.transmit()

    @property
    def busy(self) -> bool:
        return bool(self._tasks or self._pending)

    def goaway(self) -> None:
        """Refuse new requests; close once the in-flight ones are answered."""
        self._closing = True
        if not self._tasks:
            self._quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="server stopping")
            self.transmit()

    def abort(self) -> None:
        self._quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="server stopped")
        self.transmit()

    def _peer(self) -> object:
        return self._quic._network_paths[0].addr if self._quic._network_paths else None
