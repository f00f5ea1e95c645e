"""h2, the HTTP/2 library both ends use, without the per-message work SDCP does not need.

`LeanConnection` is h2's connection with:
- a whole message in one go (`fits`, `send_whole`): h2 sends a header block and a body as
  frame objects (a frame, a flags set and a validation pass each, every field coded by HPACK
  again, its own checks before each). For the messages that make up nearly all of SDCP's
  traffic (a small body that fits the flow-control windows and one frame) this frames them
  directly: a HEADERS frame with a header block coded once (hpack_blocks.header_block) and
  at most one DATA frame, the last one ending the stream, queued behind what h2 holds. The
  connection's and the stream's state move through h2's own state machines, as send_headers +
  send_data move them, so h2 keeps its books (stream states, flow-control windows) and raises
  what it would raise on a stream or connection that can no longer send. Everything else goes
  through h2 (the callers fall back when `fits` says no);
- header blocks decoded once while the HPACK table is unchanged (hpack_blocks.RememberingDecoder);
- received HEADERS and DATA frames without hyperframe's repr: h2 passes repr(frame) to its
  logger for every frame received, made whether or not anything logs, and for these two
  hyperframe serialises the body again to show its first bytes. The same frame as a
  subclass whose repr is object's (C) costs nothing of that.

`lean_config` gives h2's options as plain attributes and a logger whose calls are C no-ops;
`quiet_hpack_debug` does the same for hpack's module loggers. Relies on h2 4.x:
`_data_to_send`, `_receive_frame`, `_frame_dispatch_table`, `state_machine` of the
connection and of each stream, their inputs (h2 is pinned below 5).
"""

from __future__ import annotations

import logging
import struct
import types

import h2.config
import h2.connection
import h2.stream
import hyperframe.frame

from .hpack_blocks import RememberingDecoder

# RFC 9113 4.1: length (24 bits, as a byte and 16), type, flags, stream identifier
_FRAME_HEAD = struct.Struct(">BHBBL")
_DATA, _HEADERS = 0x0, 0x1
_END_STREAM, _END_HEADERS = 0x1, 0x4
_CONNECTION = h2.connection.ConnectionInputs
_STREAM = h2.stream.StreamInputs

# the frames of every message, as received, with object's repr (LeanConnection._receive_frame)
_QUIET_FRAMES: dict[type, type] = {
    frame_type: type(f"Received{frame_type.__name__}", (frame_type,), {"__repr__": object.__repr__})
    for frame_type in (hyperframe.frame.HeadersFrame, hyperframe.frame.DataFrame)
}


class LeanConnection(h2.connection.H2Connection):
    """h2's connection, lean where SDCP's messages go (see the module's docstring)."""

    def __init__(self, config: h2.config.H2Configuration | None = None):
        super().__init__(config)
        quiet_hpack_debug()
        remembering = RememberingDecoder()
        remembering.max_header_list_size = self.decoder.max_header_list_size
        self.decoder = remembering
        for frame_type, quiet in _QUIET_FRAMES.items():   # h2 dispatches on the exact class
            self._frame_dispatch_table[quiet] = self._frame_dispatch_table[frame_type]

    def _receive_frame(self, frame):
        quiet = _QUIET_FRAMES.get(frame.__class__)
        if quiet is not None:
            frame.__class__ = quiet
        return super()._receive_frame(frame)

    def fits(self, stream_window: int, block: bytes, body: bytes) -> bool:
        """Whether a message can leave in one HEADERS and one DATA frame now: the body within
        the connection's and the stream's window and the frame size, the block within the
        frame size, and no table size change pending that the next header block must
        announce (RFC 7541 4.2: h2's encoder writes it)."""
        size = len(body)
        limit = self.max_outbound_frame_size
        return (size <= limit and len(block) <= limit and size <= self.outbound_flow_control_window
                and size <= stream_window and not self.encoder.header_table.resized)

    def send_whole(self, stream: h2.stream.H2Stream, block: bytes, body: bytes) -> None:
        """Send `block` and `body` on `stream` and end it (the caller checked `fits`)."""
        connection, machine, stream_id, size = self.state_machine, stream.state_machine, stream.stream_id, len(body)
        connection.process_input(_CONNECTION.SEND_HEADERS)
        machine.process_input(_STREAM.SEND_HEADERS)
        if size:
            connection.process_input(_CONNECTION.SEND_DATA)
            machine.process_input(_STREAM.SEND_DATA)
        machine.process_input(_STREAM.SEND_END_STREAM)
        blocklen = len(block)
        if size:
            stream.outbound_flow_control_window -= size
            self.outbound_flow_control_window -= size
            self._data_to_send += b"".join((
                _FRAME_HEAD.pack(blocklen >> 16, blocklen & 0xFFFF, _HEADERS, _END_HEADERS, stream_id), block,
                _FRAME_HEAD.pack(size >> 16, size & 0xFFFF, _DATA, _END_STREAM, stream_id), body))
        else:
            self._data_to_send += _FRAME_HEAD.pack(blocklen >> 16, blocklen & 0xFFFF, _HEADERS,
                                                   _END_HEADERS | _END_STREAM, stream_id) + block


class PlainConfiguration(h2.config.H2Configuration):
    """h2's configuration with its options as plain instance attributes. h2 reads them
    through a Python descriptor or property each (the boolean options check their type when
    set), about ten times a message; here the class attributes below shadow those, so
    __init__ stores the values given (our own constants) and a read is an attribute read."""

    client_side = header_encoding = None
    validate_outbound_headers = normalize_outbound_headers = split_outbound_cookies = None
    validate_inbound_headers = normalize_inbound_headers = None


# h2's logger (its `logger=` option): h2 calls debug/trace a dozen times per message, and
# its default DummyLogger makes each a Python call; a C method that ignores its arguments
# discards them as well (h2's messages were never shown: it logs only to the logger given)
SILENT = types.SimpleNamespace(debug="".format, trace="".format)


def lean_config(*, client_side: bool, **options: bool) -> PlainConfiguration:
    """h2's configuration for one of our connections: bytes header fields, the silent
    logger, outbound fields neither checked nor normalised (each end builds its own from
    lowercase names and values it made), and `options` (the inbound checks)."""
    return PlainConfiguration(client_side=client_side, header_encoding=None, logger=SILENT,
                              validate_outbound_headers=False, normalize_outbound_headers=False, **options)


def quiet_hpack_debug() -> None:
    """hpack logs every header field it codes at DEBUG, through Logger.debug and
    isEnabledFor: two Python calls each, about twenty a message, for messages nobody sees.
    Where its loggers are not enabled for DEBUG when a connection starts (logs.setup has set
    the levels by then), their debug() becomes a C method that ignores its arguments, for the
    life of the process; a process started at DEBUG keeps hpack's messages."""
    for name in ("hpack.hpack", "hpack.table"):
        logger = logging.getLogger(name)
        if not logger.isEnabledFor(logging.DEBUG):
            logger.debug = "".format   # type: ignore[method-assign]
