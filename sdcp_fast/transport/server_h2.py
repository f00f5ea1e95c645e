"""HTTP/2 over TLS 1.3 (TCP) on the sans-IO h2 state machine.

Each accepted TCP connection is paused, upgraded with `loop.start_tls` (so a failed handshake
reaches our code and is logged with OpenSSL's reason instead of vanishing inside asyncio),
its client certificate's URI SAN read, and then handed to `H2ServerProtocol`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from sdcp_fast.core.problems import Problem

from .exchange import IncomingRequest, PendingBodies, respond_to, response_headers
from .http import Response, body_timeout_response, problem_response
from .identity import CertificateRejected, uri_identity_der
from .serving import Serving

log = logging.getLogger("sdcp_fast.transport")
DISCARD_LIMIT = 4 << 20  # bytes of a refused upload read and dropped before resetting the stream


class TLSAcceptor(asyncio.Protocol):
    """Raw TCP connection until the TLS 1.3 handshake with a client certificate completes."""

    def __init__(self, serving: Serving):
        self._serving = serving

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the ClientHello must reach the TLS layer, not this protocol
        self._serving.spawn(self._handshake(transport))

    async def _handshake(self, raw: asyncio.Transport) -> None:
        peer = raw.get_extra_info("peername")
        protocol = H2ServerProtocol(self._serving, peer)
        loop = asyncio.get_running_loop()
        try:
            tls_transport = await loop.start_tls(
                raw, protocol, self._serving.ssl_context, server_side=True,
                ssl_handshake_timeout=self._serving.handshake_timeout,
            )
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError) as exc:
            log.info("h2: refused TLS from %s: %s", peer, _reason(exc))
            raw.close()  # not abort(): let OpenSSL's alert reach the client, it says why
            return
        if tls_transport is None:  # closed during the handshake
            raw.abort()
            return
        ssl_object = tls_transport.get_extra_info("ssl_object")
        try:
            der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
            if not der:
                raise CertificateRejected(CertificateRejected.MISSING, "no client certificate")
            caller = uri_identity_der(der)
        except CertificateRejected as exc:
            log.info("h2: refused client %s: %s", peer, exc)
            tls_transport.abort()
            return
        log.info("h2: connection from %s as %s (%s)", peer, caller, ssl_object.version())
        protocol.caller = caller
        protocol.connection_made(tls_transport)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.reason}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return f"{type(exc).__name__}: {exc}"


class H2ServerProtocol(asyncio.Protocol):
    def __init__(self, serving: Serving, peer: object):
        self._serving = serving
        self._peer = peer
        self.caller: str | None = None
        self._transport: asyncio.Transport | None = None
        self._conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self._pending = PendingBodies(serving.body_timeout, self._body_overdue)  # bodies arriving
        self._discarding: dict[int, int] = {}  # refused uploads still arriving -> bytes still allowed
        self._tasks: dict[int, asyncio.Task[None]] = {}  # streams being answered
        self._window_open = asyncio.Event()  # flow-control credit arrived
        self._writable = asyncio.Event()  # transport buffer below its high-water mark
        self._writable.set()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        self._closing = False
        # Bytes decrypted together with the client's Finished reach data_received before
        # TLSAcceptor has read the certificate and called connection_made: keep them.
        self._early: list[bytes] = []

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # start_tls does not call this; TLSAcceptor does, once the caller is known.
        if self.caller is None:
            return
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._serving.connections.add(self)
        self._conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self._serving.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 16384,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        self._conn.initiate_connection()
        self._flush()
        self._arm_idle_timer()
        early, self._early = b"".join(self._early), []
        if early:
            self.data_received(early)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            if sum(map(len, self._early)) + len(data) <= 1 << 20:  # bounded: 1 MiB
                self._early.append(data)
            return
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.info("h2: protocol error from %s (%s): %s", self._peer, self.caller, exc)
            self._flush()  # h2 has queued a GOAWAY
            self._transport.close()
            return
        for event in events:
            self._on_event(event)
        self._flush()
        self._last_activity = asyncio.get_running_loop().time()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:  # the handshake failed; TLSAcceptor logged why
            return
        self._serving.connections.discard(self)
        for task in self._tasks.values():
            task.cancel()
        self._pending.clear()
        self._window_open.set()
        self._writable.set()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        log.info("h2: connection from %s (%s) closed%s", self._peer, self.caller, f": {exc}" if exc else "")

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- h2 events ----------------------------------------------------------------------
    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._on_headers(event.stream_id, event.headers, event.stream_ended is not None)
        elif isinstance(event, h2.events.DataReceived):
            # Credit is returned whatever happens to the bytes: the limit is enforced per stream.
            self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            incoming = self._pending.get(event.stream_id)
            if incoming is not None:
                refusal = incoming.add_body(event.data)
                if refusal is not None:
                    self._refuse(event.stream_id, refusal, request_complete=False)
            elif event.stream_id in self._discarding:
                self._discard(event.stream_id, len(event.data))
        elif isinstance(event, h2.events.StreamEnded):
            self._discarding.pop(event.stream_id, None)
            incoming = self._pending.take(event.stream_id)
            if incoming is not None:
                self._start(event.stream_id, incoming)
        elif isinstance(event, h2.events.StreamReset):
            self._pending.take(event.stream_id)
            self._discarding.pop(event.stream_id, None)
            task = self._tasks.pop(event.stream_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window_open.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            log.info("h2: %s (%s) sent GOAWAY (%s)", self._peer, self.caller, event.error_code)
            self._closing = True
            if not self._tasks:
                self._close_now()

    def _on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        if self._closing:  # not processed: the client may safely retry elsewhere (RFC 9113 8.7)
            self._conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        incoming = IncomingRequest.from_headers(headers, self._serving.max_body)
        if isinstance(incoming, Problem):
            self._refuse(stream_id, incoming, request_complete=ended)
        elif ended:
            self._start(stream_id, incoming)
        else:
            self._pending.add(stream_id, incoming)

    def _body_overdue(self, stream_id: int) -> None:
        """The body is still incomplete `body_timeout` after the headers: 408, then reset.

        A stalled client gets its answer and the stream ends (RST_STREAM(NO_ERROR) after a
        complete response, RFC 9113 8.1), freeing its buffer and its concurrency slot.
        """
        if self._transport is None:
            return
        log.info("h2: stream %d from %s -> 408: body not complete within %ss",
                 stream_id, self.caller, self._serving.body_timeout)
        response = body_timeout_response(self._serving.body_timeout)
        try:
            self._conn.send_headers(stream_id, response_headers(response))
            self._conn.send_data(stream_id, response.body, end_stream=True)
            self._conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.H2Error as exc:  # the stream ended meanwhile
            log.debug("h2: could not answer stream %d: %s", stream_id, exc)
        self._flush()

    def _refuse(self, stream_id: int, problem: Problem, *, request_complete: bool) -> None:
        """Answer from the transport, before the upload (if any) has ended.

        RFC 9113 8.1 lets a server cut the upload off with RST_STREAM(NO_ERROR) after a complete
        response, but httpx/httpcore then waits for flow-control credit that never comes and
        times out instead of reading the answer. So the rest of the upload is read and dropped
        (never stored) up to DISCARD_LIMIT bytes, and only a longer one is reset.
        """
        self._pending.take(stream_id)
        log.info("h2: stream %d from %s -> %d %s", stream_id, self.caller, problem.status, problem.detail)
        response = problem_response(problem)
        self._conn.send_headers(stream_id, response_headers(response))
        self._conn.send_data(stream_id, response.body, end_stream=True)  # small: fits any window
        if not request_complete:
            self._discarding[stream_id] = DISCARD_LIMIT

    def _discard(self, stream_id: int, size: int) -> None:
        budget = self._discarding[stream_id] - size
        if budget >= 0:
            self._discarding[stream_id] = budget
            return
        del self._discarding[stream_id]
        self._conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)

    def _start(self, stream_id: int, incoming: IncomingRequest) -> None:
        request = incoming.finish(self.caller)
        task = self._serving.spawn(self._answer(stream_id, request))
        self._tasks[stream_id] = task

    async def _answer(self, stream_id: int, request) -> None:
        try:
            response = await respond_to(self._serving.handler, request, self._serving.handler_timeout)
            await self._send(stream_id, response)
        except h2.exceptions.StreamClosedError:
            pass  # the client reset the stream meanwhile
        finally:
            self._tasks.pop(stream_id, None)
            self._last_activity = asyncio.get_running_loop().time()
            if self._closing and not self._tasks:
                self._close_now()

    async def _send(self, stream_id: int, response: Response) -> None:
        self._conn.send_headers(stream_id, response_headers(response), end_stream=not response.body)
        view = memoryview(response.body)
        while view:
            await self._writable.wait()
            window = min(self._conn.local_flow_control_window(stream_id), self._conn.max_outbound_frame_size)
            if window <= 0:
                self._window_open.clear()
                self._flush()
                await self._window_open.wait()
                if self._transport is None or self._transport.is_closing():
                    return
                continue
            chunk, view = view[:window], view[window:]
            self._conn.send_data(stream_id, bytes(chunk), end_stream=not view)
            self._flush()
        self._flush()

    # ---- housekeeping --------------------------------------------------------------------
    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _arm_idle_timer(self) -> None:
        """One timer per connection, re-armed only when it fires (not per packet)."""
        loop = asyncio.get_running_loop()
        self._last_activity = loop.time()
        self._idle_timer = loop.call_later(self._serving.idle_timeout, self._idle_check)

    def _idle_check(self) -> None:
        idle_for = asyncio.get_running_loop().time() - self._last_activity
        if self._tasks or self._pending or idle_for < self._serving.idle_timeout:
            remaining = self._serving.idle_timeout - idle_for
            self._idle_timer = asyncio.get_running_loop().call_later(
                max(remaining, 0.05), self._idle_check)
            return
        log.info("h2: closing idle connection from %s (%s)", self._peer, self.caller)
        self.goaway()

    @property
    def busy(self) -> bool:
        """Answers still to send (stop() waits for these, not for the TLS close exchange)."""
        return bool(self._tasks or self._pending)

    def goaway(self) -> None:
        """Graceful close: refuse new streams (REFUSED_STREAM: safe to retry), answer the ones in
        flight, then GOAWAY and close. No early GOAWAY: httpx/httpcore fails every stream still
        open on a connection once it has seen one, instead of waiting for their answers."""
        self._closing = True
        if not self._tasks:
            self._close_now()

    def _close_now(self) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        try:
            self._conn.close_connection(h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            pass  # already closed by the peer's GOAWAY
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
