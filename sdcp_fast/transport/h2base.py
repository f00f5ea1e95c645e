"""What the HTTP/2 client and server connections share on ngh2's public API (libnghttp2): the
write side (a message queued whole: libnghttp2 sends its body as flow control allows, and
returns credit for what it receives on its own), waiting for a body to leave, the frames we
write ourselves, and the connection's end."""

from __future__ import annotations

import asyncio
import contextlib

import ngh2

ErrorCodes = ngh2.ErrorCode
Setting = ngh2.Setting
_SETTINGS, _GOAWAY = 0x4, 0x7


def frame(kind: int, payload: bytes) -> bytes:
    """One frame on stream 0, no flags (RFC 9113 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes((kind, 0)) + bytes(4) + payload


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(_SETTINGS, ngh2.pack_settings_payload(settings))


def goaway_frame(last_stream_id: int, code: int, reason: bytes = b"") -> bytes:
    return frame(_GOAWAY, last_stream_id.to_bytes(4, "big") + int(code).to_bytes(4, "big") + reason)


class H2Endpoint(asyncio.Protocol):
    """One HTTP/2 connection's `ngh2` state (`_conn`) and the transport it writes to."""

    def __init__(self, conn: ngh2.Connection):
        self._conn = conn
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._window_open = asyncio.Event()   # flow-control credit arrived (or the connection ended)
        self._transmit_queued = False   # a transmit waits for the end of this loop turn (or ran since)

    def transmit(self) -> None:
        """Write what libnghttp2 has queued (nothing once a connection error ended it)."""
        self._transmit_queued = False
        try:
            data = self._conn.data_to_send()
        except ngh2.NGH2Error:
            return
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def transmit_soon(self) -> None:
        """Write what libnghttp2 has queued at the end of this loop turn (a batch's messages,
        written one after another in one turn, leave in one write)."""
        if not self._transmit_queued:
            self._transmit_queued = True
            self._loop.call_soon(self.transmit)

    def _goaway_and_close(self, code: int = ErrorCodes.NO_ERROR, reason: bytes | None = None) -> None:
        """GOAWAY with `code` and `reason`, what is queued, then the close (unless the
        connection is closing already)."""
        if self._transport is None or self._transport.is_closing():
            return
        with contextlib.suppress(ngh2.NGH2Error):   # already ending (the peer's GOAWAY, or ours)
            self._conn.send_goaway(code, debug_data=reason or b"")
        self.transmit()
        self._transport.close()

    def _reset(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(ngh2.NGH2Error):
            self._conn.reset_stream(stream_id, code)
        self.transmit()

    def _fits(self, stream_id: int, size: int) -> bool:
        """Whether `size` octets of DATA fit the stream's and the connection's windows now."""
        return size <= min(self._conn.stream_remote_window_size(stream_id), self._conn.remote_window_size)

    async def _sent(self, stream_id: int, stall_s: float | None, stop: asyncio.Future | None = None) -> str:
        """Wait until the body queued on `stream_id` has left: "sent" (or the stream is gone);
        "stalled" when none of it left for `stall_s` seconds (None: no limit); "stopped" when
        the connection ended first, or `stop` is done (the answer came before the upload ended)."""
        conn, wake = self._conn, self._window_open
        if stop is not None:
            stop.add_done_callback(lambda _: wake.set())
        self.transmit()
        queued, since = conn.queued_body_size(stream_id), self._loop.time()
        while queued:
            if self._transport is None or self._transport.is_closing() or (stop is not None and stop.done()):
                return "stopped"
            left = None if stall_s is None else since + stall_s - self._loop.time()
            if left is not None and left <= 0:
                return "stalled"
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await wake.wait()
            self.transmit()
            now_queued = conn.queued_body_size(stream_id)
            if now_queued < queued:
                since = self._loop.time()
            queued = now_queued
        return "sent"


def error_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"{code:#x}"
