"""A whole HTTP/2 message (a request, an answer) in one go over h2's state.

h2 sends a header block and a body as frame objects: a frame, a flags set and a validation
pass each, every field coded by HPACK again, and its own checks before each. For the
messages that make up nearly all of SDCP's traffic (a small body that fits the flow-control
windows and one frame) this frames them directly: a HEADERS frame with a header block coded
once (hpack_blocks.header_block) and at most one DATA frame, the last one ending the stream,
queued behind what h2 holds. The connection's and the stream's state move through h2's own
state machines, as send_headers + send_data move them, so h2 keeps its books (stream states,
flow-control windows) and raises what it would raise on a stream or connection that can no
longer send. Everything else goes through h2 (the callers fall back when `fits` says no).
Relies on h2 4.x: `_data_to_send`, `state_machine` of the connection and of each stream,
their inputs.
"""

from __future__ import annotations

import struct

import h2.connection
import h2.stream

# RFC 9113 4.1: length (24 bits, as a byte and 16), type, flags, stream identifier
_FRAME_HEAD = struct.Struct(">BHBBL")
_DATA, _HEADERS = 0x0, 0x1
_END_STREAM, _END_HEADERS = 0x1, 0x4
_CONNECTION = h2.connection.ConnectionInputs
_STREAM = h2.stream.StreamInputs


def fits(conn: h2.connection.H2Connection, stream_window: int, block: bytes, body: bytes) -> bool:
    """Whether the message can leave in one HEADERS and one DATA frame now: the body within
    the connection's and the stream's window and the frame size, the block within the frame
    size, and no table size change pending that the next header block must announce (RFC
    7541 4.2: h2's encoder writes it)."""
    size = len(body)
    limit = conn.max_outbound_frame_size
    return (size <= limit and len(block) <= limit and size <= conn.outbound_flow_control_window
            and size <= stream_window and not conn.encoder.header_table.resized)


def send_whole(conn: h2.connection.H2Connection, stream: h2.stream.H2Stream, block: bytes, body: bytes) -> None:
    """Send `block` and `body` on `stream` and end it (the caller checked `fits`)."""
    connection, machine, stream_id, size = conn.state_machine, stream.state_machine, stream.stream_id, len(body)
    connection.process_input(_CONNECTION.SEND_HEADERS)
    machine.process_input(_STREAM.SEND_HEADERS)
    if size:
        connection.process_input(_CONNECTION.SEND_DATA)
        machine.process_input(_STREAM.SEND_DATA)
    machine.process_input(_STREAM.SEND_END_STREAM)
    blocklen = len(block)
    if size:
        stream.outbound_flow_control_window -= size
        conn.outbound_flow_control_window -= size
        conn._data_to_send += b"".join((
            _FRAME_HEAD.pack(blocklen >> 16, blocklen & 0xFFFF, _HEADERS, _END_HEADERS, stream_id), block,
            _FRAME_HEAD.pack(size >> 16, size & 0xFFFF, _DATA, _END_STREAM, stream_id), body))
    else:
        conn._data_to_send += _FRAME_HEAD.pack(blocklen >> 16, blocklen & 0xFFFF, _HEADERS,
                                               _END_HEADERS | _END_STREAM, stream_id) + block
