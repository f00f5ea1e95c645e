"""What the HTTP/2 client and server connections share on jh2's public API: the write side
(the socket's flow control and HTTP/2's), a message queued for one write, and the rest of a
body sent as credit allows."""

from __future__ import annotations

import asyncio
import contextlib
import types

import jh2.config
import jh2.connection
import jh2.errors
import jh2.events
import jh2.exceptions

ErrorCodes = jh2.errors.ErrorCodes
CREDIT_BATCH = 1 << 15   # connection credit for ended streams' data is returned in steps of this many bytes


class PlainConfiguration(jh2.config.H2Configuration):
    """jh2's configuration with its options as plain attributes: jh2 reads them several times
    a message, each through a Python descriptor; these class attributes shadow those, so
    the values given are stored and read as they are (our constants: no check needed)."""

    client_side = header_encoding = None
    validate_outbound_headers = normalize_outbound_headers = split_outbound_cookies = None
    validate_inbound_headers = normalize_inbound_headers = None


# jh2's `logger=` option: a C method that ignores its arguments (jh2 logs only to the logger
# it is given; its default makes each of its debug calls a Python call)
SILENT = types.SimpleNamespace(debug="".format, trace="".format)


def configuration(*, client_side: bool) -> PlainConfiguration:
    """Both ends' options: header fields as bytes, neither checked nor normalised by jh2 (a
    server checks a request's fields itself, exchange.malformed; each end builds its own
    from lowercase names and values it made; an answer comes from a server that proved its
    certificate, and a field it gets wrong fails that request)."""
    return PlainConfiguration(client_side=client_side, header_encoding=None, logger=SILENT,
                              validate_outbound_headers=False, normalize_outbound_headers=False,
                              validate_inbound_headers=False, normalize_inbound_headers=False)


class H2Endpoint(asyncio.Protocol):
    """One HTTP/2 connection's `jh2` state (`_conn`) and the transport it writes to."""

    def __init__(self, conn: jh2.connection.H2Connection):
        self._conn = conn
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._window_open = asyncio.Event()   # flow-control credit arrived
        self._writable = asyncio.Event()      # transport buffer below its high-water mark
        self._writable.set()
        self._transmit_queued = False   # a transmit waits for the end of this loop turn (or ran since)
        self._uncredited = 0   # bytes of ended streams' DATA not yet credited to the connection

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def transmit(self) -> None:
        """Write what jh2 has queued."""
        self._transmit_queued = False
        data = self._conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def transmit_soon(self) -> None:
        """Write what jh2 has queued at the end of this loop turn (a batch's messages, written
        one after another in one turn, leave in one write)."""
        if not self._transmit_queued:
            self._transmit_queued = True
            self._loop.call_soon(self.transmit)

    def _goaway_and_close(self, code: int = ErrorCodes.NO_ERROR, reason: bytes | None = None) -> None:
        """GOAWAY with `code` and `reason`, what is queued, then the close (unless the
        connection is closing already)."""
        if self._transport is None or self._transport.is_closing():
            return
        with contextlib.suppress(jh2.exceptions.H2Error):   # already closed by the peer's GOAWAY
            self._conn.close_connection(code, additional_data=reason)
        self.transmit()
        self._transport.close()

    def _credit(self, event: jh2.events.DataReceived) -> None:
        """Flow-control credit for a DATA frame read: on its stream and the connection while
        the stream still receives; once it ended, on the connection alone, in batches."""
        if event.stream_ended is None:
            self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        self._uncredited += event.flow_controlled_length
        if self._uncredited >= CREDIT_BATCH:
            self._conn.increment_flow_control_window(self._uncredited)
            self._uncredited = 0

    def _reset(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(jh2.exceptions.H2Error):
            self._conn.reset_stream(stream_id, code)
        self.transmit()

    def _send_message(self, stream_id: int, headers, body: bytes) -> bytes:
        """A message's HEADERS and, when its body fits the window and the frame size, one DATA
        frame with all of it, queued together; the part of the body still to send (b"": none).
        Raises jh2's H2Error when the stream cannot take the headers."""
        self._conn.send_headers(stream_id, headers, end_stream=not body)
        if body:
            # jh2 checks the window and the frame size before it changes anything
            with contextlib.suppress(jh2.exceptions.FlowControlError, jh2.exceptions.FrameTooLargeError):
                self._conn.send_data(stream_id, body, end_stream=True)
                body = b""
        return body

    async def _send_rest(self, stream_id: int, body: bytes, stall_s: float | None,
                         stop: asyncio.Future | None = None) -> str:
        """`body` as flow control allows, then the stream's end: "sent"; "stalled" when no
        credit came for `stall_s` seconds (None: no limit); "stopped" when the connection or
        the stream ended first, or `stop` is done (the answer came before the upload ended)."""
        view = memoryview(body)
        stalled_since: float | None = None
        while view:
            if not self._writable.is_set():
                self.transmit()
                await self._writable.wait()
            if self._transport is None or self._transport.is_closing() or (stop is not None and stop.done()):
                return "stopped"
            try:
                window = min(self._conn.local_flow_control_window(stream_id), self._conn.max_outbound_frame_size)
            except jh2.exceptions.H2Error:
                return "stopped"   # reset meanwhile
            if window <= 0:
                stalled_since = stalled_since or self._loop.time()
                left = None if stall_s is None else stalled_since + stall_s - self._loop.time()
                if left is not None and left <= 0:
                    return "stalled"
                self._window_open.clear()
                self.transmit()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._window_open.wait()
                continue
            stalled_since = None
            chunk, view = view[:window], view[window:]
            self._conn.send_data(stream_id, bytes(chunk), end_stream=not view)
        self.transmit()
        return "sent"


def error_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"{code:#x}"
