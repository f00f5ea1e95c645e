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
  subclass whose repr is object's (C) costs nothing of that;
- received frames split without h2's frame buffer (`receive_data`): h2 copies what arrives
  into a buffer, then per frame makes a header view, a frame object with a flags set (a
  Python object checking each flag added), a body view and a copy. A whole HEADERS frame
  carrying a whole header block, and a whole DATA frame, neither padded nor with a
  priority (every SDCP message), is read here straight from the bytes received into the
  same frame object, fields set, and handed to h2's own `_receive_frame`: the stream states,
  flow-control books, events and every error are h2's. Any other frame, a frame cut at the
  end of what arrived, and everything while h2 holds part of a frame or of a header block,
  goes through h2's buffer as before. A HEADERS frame followed by the DATA frame that ends
  its stream, both whole, is offered to `_receive_message` first: a server takes a new
  request there in one go (server_h2.ServerConnection), through h2's state machines and
  stream methods, without the frame dispatch between them.

A stream's state machine moves along a path of h2's own transitions (`stream_path`, `walk`):
h2's process_input looks each input up in its table by a key that hashes a Python Enum (one
Python call per input, two for the connection's); a path is looked up once, from h2's table,
and walked with h2's callbacks, their errors ending as in process_input. The connection's
state machine is left alone in the states where h2's table keeps it as it is for a
message's inputs (`QUIET_CONNECTION_STATES`: the open ones).

`lean_config` gives h2's options as plain attributes and a logger whose calls are C no-ops;
`quiet_hpack_debug` does the same for hpack's module loggers. Relies on h2 4.x:
`_data_to_send`, `_receive_frame`, `_frame_dispatch_table`, `_terminate_connection`,
`incoming_buffer`'s `_data`, `_headers_buffer` and `_preamble_len`, `state_machine` of the
connection and of each stream, their inputs and states, the transition tables
(`h2.stream._transitions`, `H2ConnectionStateMachine._transitions`: (state, input) ->
(callback or None, next state), callbacks taking the machine and the previous state), the
stream machine's `stream_closed_by` (h2 is pinned below 5), and the attributes hyperframe's
HEADERS and DATA frames get from parsing; the server's `_receive_message` also
`_decode_headers`, `_begin_new_stream`, `AllowedStreamIDs`, `ConnectionState`, the inbound
window managers (the connection's and the stream's `_inbound_window_manager`), the stream's
`_initialize_content_length` and `_track_content_length`, `is_informational_response`,
the settings' `_settings` (code -> values, the current one first) and what
`_begin_new_stream` does to a new stream (`H2Stream`'s arguments, `max_outbound_frame_size`,
`streams`, `highest_inbound_stream_id`); its `send_whole_answer` the connection's
`_closed_streams` (a SizeLimitDict: an OrderedDict, `_size_limit`, `_check_size_limit`);
its `acknowledge_request_data` the window managers' `process_bytes`, `STREAM_OPEN` and
`_prepare_for_sending`.
"""

from __future__ import annotations

import logging
import struct
import types

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.stream
import hyperframe.frame

from .hpack_blocks import RememberingDecoder

# RFC 9113 4.1: length (24 bits, as a byte and 16), type, flags, stream identifier
_FRAME_HEAD = struct.Struct(">BHBBL")
_DATA, _HEADERS = 0x0, 0x1
_END_STREAM, _END_HEADERS = 0x1, 0x4
_CONNECTION = h2.connection.ConnectionInputs
_STREAM = h2.stream.StreamInputs
_STATE = h2.stream.StreamState
_STREAM_TRANSITIONS = h2.stream._transitions   # (state, input) -> (callback or None, next state)

_STREAM_ID = 0x7FFFFFFF   # the reserved bit is ignored on receipt (RFC 9113 4.1)

# the frames of every message, as received, with object's repr (LeanConnection._receive_frame)
_QUIET_FRAMES: dict[type, type] = {
    frame_type: type(f"Received{frame_type.__name__}", (frame_type,), {"__repr__": object.__repr__})
    for frame_type in (hyperframe.frame.HeadersFrame, hyperframe.frame.DataFrame)
}
_RECEIVED_HEADERS = _QUIET_FRAMES[hyperframe.frame.HeadersFrame]
_RECEIVED_DATA = _QUIET_FRAMES[hyperframe.frame.DataFrame]
# the flags of a frame read in receive_data, by flag byte ('END_STREAM' in frame.flags is all
# h2 asks of them; a header block h2 assembles from CONTINUATION frames never comes here)
_HEADERS_FLAGS = {_END_HEADERS: frozenset({"END_HEADERS"}),
                  _END_HEADERS | _END_STREAM: frozenset({"END_HEADERS", "END_STREAM"})}
_DATA_FLAGS = {0: frozenset(), _END_STREAM: frozenset({"END_STREAM"})}


def _quiet_connection_states() -> tuple[h2.connection.ConnectionState, ...]:
    """The connection states in which h2's connection state machine takes a message's inputs
    (headers and data, sent and received) without a callback or a change of state: the open
    ones, read from h2's own table. There, process_input would only look the input up."""
    table = h2.connection.H2ConnectionStateMachine._transitions
    inputs = (_CONNECTION.SEND_HEADERS, _CONNECTION.SEND_DATA, _CONNECTION.RECV_HEADERS, _CONNECTION.RECV_DATA)
    return tuple(state for state in h2.connection.ConnectionState
                 if all(table.get((state, input_)) == (None, state) for input_ in inputs))


# a tuple, for `in`: it compares by identity in C (a set would hash each Enum in Python)
QUIET_CONNECTION_STATES = _quiet_connection_states()


def stream_path(state: h2.stream.StreamState, *inputs: h2.stream.StreamInputs) -> tuple | None:
    """The steps h2's stream state machine takes for `inputs` from `state`, from its own
    table: ((callback or None, next state), ...); None where one of them is not allowed
    (h2's process_input raises there). `walk` applies them."""
    steps = []
    for input_ in inputs:
        step = _STREAM_TRANSITIONS.get((state, input_))
        if step is None:
            return None
        steps.append(step)
        state = step[1]
    return tuple(steps)


def walk(machine: h2.stream.H2StreamStateMachine, steps: tuple) -> list[h2.events.Event]:
    """Move a stream's state machine along `steps` (`stream_path`, from the state it is in):
    what process_input does for each of those inputs, its callbacks and their errors
    included, without looking each input up again (a Python Enum's hash each)."""
    events: list[h2.events.Event] = []
    for callback, state in steps:
        previous, machine.state = machine.state, state
        if callback is not None:
            try:
                events += callback(machine, previous)
            except h2.exceptions.ProtocolError:
                machine.state = _STATE.CLOSED
                raise
            except AssertionError as err:
                machine.state = _STATE.CLOSED
                raise h2.exceptions.ProtocolError(err) from err
    return events


# send_whole's inputs (a HEADERS frame, a DATA frame if any, the end of the stream), by the
# stream's state and whether a body goes: the paths h2 allows, from every state
_WHOLE_PATHS = {
    (state, bool(body)): path
    for state in _STATE for body in (0, 1)
    if (path := stream_path(state, _STREAM.SEND_HEADERS, *([_STREAM.SEND_DATA] if body else []),
                            _STREAM.SEND_END_STREAM)) is not None
}


def received_data_frame(stream_id: int, data: bytes, flags: int = _END_STREAM):
    """A DATA frame as received (no padding), for h2's `_receive_frame`; `flags` 0 or
    END_STREAM."""
    frame = object.__new__(_RECEIVED_DATA)
    frame.stream_id, frame.flags, frame.pad_length, frame.body_len, frame.data = (
        stream_id, _DATA_FLAGS[flags], 0, len(data), data)
    return frame


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

    def receive_data(self, data) -> list[h2.events.Event]:
        """h2's `receive_data`, with whole HEADERS and DATA frames read here (see the
        module's docstring); everything else is h2's, frame by frame, in order."""
        buffer = self.incoming_buffer
        if buffer._data or buffer._headers_buffer or buffer._preamble_len:
            return super().receive_data(data)
        data = bytes(data)
        events: list[h2.events.Event] = []
        pos, size, limit = 0, len(data), self.max_inbound_frame_size
        while pos < size:
            if size - pos < 9:
                events += super().receive_data(data[pos:])   # h2 keeps the start of a frame
                break
            high, low, kind, flags, stream_id = _FRAME_HEAD.unpack_from(data, pos)
            length = high << 16 | low
            end = pos + 9 + length
            stream_id &= _STREAM_ID
            frame = None
            if end <= size and length <= limit and stream_id:
                if kind == _HEADERS and flags == _END_HEADERS and size - end >= 9:
                    # a message whose DATA frame follows: the connection may take both at once
                    high, low, next_kind, next_flags, next_id = _FRAME_HEAD.unpack_from(data, end)
                    next_length = high << 16 | low
                    after = end + 9 + next_length
                    if (next_kind == _DATA and next_flags == _END_STREAM and next_id & _STREAM_ID == stream_id
                            and next_length <= limit and after <= size):
                        try:
                            taken = self._receive_message(stream_id, data[pos + 9:end], data[end + 9:after])
                        except h2.exceptions.ProtocolError as exc:   # as below
                            self._terminate_connection(exc.error_code)
                            raise
                        if taken is not None:
                            events += taken
                            pos = after
                            continue
                if kind == _DATA and flags in _DATA_FLAGS:
                    frame = object.__new__(_RECEIVED_DATA)
                    frame.flags = _DATA_FLAGS[flags]
                elif kind == _HEADERS and flags in _HEADERS_FLAGS:
                    frame = object.__new__(_RECEIVED_HEADERS)
                    frame.flags = _HEADERS_FLAGS[flags]
                    frame.depends_on = frame.stream_weight = 0
                    frame.exclusive = False
            if frame is None:   # h2's
                if end >= size:   # the last frame, whole or cut (h2 keeps what is cut)
                    events += super().receive_data(data[pos:])
                    break
                events += super().receive_data(data[pos:end])
                pos = end
                if buffer._headers_buffer:   # a header block goes on in CONTINUATION frames
                    events += super().receive_data(data[pos:])
                    break
                limit = self.max_inbound_frame_size   # a SETTINGS ack may have changed it
                continue
            frame.stream_id, frame.pad_length, frame.body_len = stream_id, 0, length
            frame.data = data[pos + 9:end]
            pos = end
            try:
                events += self._receive_frame(frame)
            except h2.exceptions.ProtocolError as exc:   # as h2's receive_data: GOAWAY queued, raised
                self._terminate_connection(exc.error_code)
                raise
        return events

    def _receive_message(self, stream_id: int, block: bytes, body: bytes) -> list[h2.events.Event] | None:
        """A whole message received: a HEADERS frame holding header block `block` that does not
        end the stream, then the DATA frame of `body` that does, both whole. The events h2
        would give for the two frames, or None, with nothing changed, where they must go
        through h2's frame handling one by one (here: always; a server takes its requests)."""
        return None

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
        path = _WHOLE_PATHS.get((machine.state, size > 0))
        if path is not None and connection.state in QUIET_CONNECTION_STATES:
            walk(machine, path)   # the connection's machine would stay as it is
        else:   # h2's process_input, input by input: it raises what it raises
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
