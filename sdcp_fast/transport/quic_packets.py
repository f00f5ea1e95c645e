"""1-RTT packets of an established connection written and read with less of aioquic's generality.

aioquic 1.7.2 spends as much Python on one small packet as on a big one, and a lone SDCP
session sends one small packet each way per round. Two of its costs go here:
  - Writing: `QuicConnection._write_application` fills packets in a loop that ends only when a
    freshly started packet stays empty, so every transmit that sends one packet (every request
    and every answer of a lone session) starts a second one (its own `QuicSentPacket`, every
    frame check, a walk over the streams) and drops it. `LeanQuic` writes the first packet as
    aioquic writes it (its own frame writers, in its order) and then asks whether aioquic's
    next turn could write anything; only then does aioquic's loop run on. (That empty turn is
    also where aioquic finds out that a stream's buffer is empty, `QuicStreamSender.get_frame`;
    `_more_to_write` marks it so instead.) That first packet is built without aioquic's
    QuicPacketBuilder, whose datagram and multi-packet books a lone 1-RTT packet does not
    need: a `_OnePacket` gives the frame writers what they use of a builder, and the packet
    is ended, encrypted and registered as `_end_packet` and `_flush_builder` do it.
  - Reading: `QuicConnection.receive_datagram` parses every header into a `QuicHeader`, looks
    the packet type, epoch, crypto pair, packet space and destination connection ID up, and
    tests for qlog, retries, version negotiation and migration, for every packet. A datagram
    that is one 1-RTT packet to the connection ID in use, from the active path's address, is
    read here with the same steps in the same order, less those that cannot apply.
  - Both: the 1-RTT crypto pair, crypto stream and packet space are looked up once (aioquic
    looks them up in enum-keyed dicts, a Python-level `Enum.__hash__` call each, several per
    packet).
Together they cut a round's QUIC instructions by about a quarter at each end.

The shortcuts are taken in the steady state of an established connection only (handshake
complete; no handshake data, HANDSHAKE_DONE, path validation, connection IDs, STREAMS_BLOCKED,
PING or DATAGRAM to send; no qlog): anything else takes aioquic's methods unchanged. Nothing
else changes: the same frames in the same packets, the same events, the same loss-recovery,
ACK, pacing and flow-control bookkeeping (tests/transport/test_quic_packets.py drives a plain
and a lean connection pair through the same script and compares the plaintext of every packet,
every event and that bookkeeping after each step).

Installed per connection by swapping the instance's class (`LeanQuic.adopt`), as quic_mtls.py
does for TLS contexts; it adds no state to `__init__`. The private names it reads are checked by
quic_mtls.check_aioquic().
"""

from __future__ import annotations

from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic.connection import (
    QuicConnection,
    QuicConnectionError,
    QuicConnectionState,
    QuicReceiveContext,
    stream_is_client_initiated,
)
from aioquic.quic.crypto import CryptoError
from aioquic.quic.packet import (
    NON_ACK_ELICITING_FRAME_TYPES,
    NON_IN_FLIGHT_FRAME_TYPES,
    PACKET_FIXED_BIT,
    PACKET_NUMBER_MAX_SIZE,
    QuicErrorCode,
    QuicFrameType,
    QuicPacketType,
    get_spin_bit,
)
from aioquic.quic.packet_builder import (
    PACKET_NUMBER_SEND_SIZE,
    QuicPacketBuilderStop,
    QuicSentPacket,
)
from aioquic.quic.recovery import MAX_ACK_RANGES

_ONE_RTT = tls.Epoch.ONE_RTT
_ONE_RTT_PACKET = QuicPacketType.ONE_RTT
_CONNECTED = QuicConnectionState.CONNECTED
_SHORT_HEADER = 0x40   # the first octet's two high bits: short header (0), fixed bit (1)
_ONE_RTT_RESERVED_BITS = 0x18
# room the first frame leaves for the padding that lets header protection sample (RFC 9001 5.4.2)
_FIRST_FRAME_ROOM = PACKET_NUMBER_MAX_SIZE - PACKET_NUMBER_SEND_SIZE
_CRYPTO_FRAME = QuicFrameType.CRYPTO

# what LeanQuic reads or calls of aioquic's QuicConnection, besides what its __init__ sets
READ_NAMES = ("_write_application", "_write_ack_frame", "_write_connection_limits", "_write_stream_limits",
              "_write_stream_frame", "_write_stop_sending_frame", "_write_reset_stream_frame", "_stream_limit",
              "_payload_received", "_idle_timeout")
# what QuicStreamSender.__init__ sets, that LeanQuic reads
SENDER_NAMES = ("_pending", "_pending_eof", "buffer_is_empty", "reset_pending")
# what QuicConnection.__init__ or _initialize set, that LeanQuic reads
STATE_NAMES = ("_cryptos", "_crypto_streams", "_spaces", "_handshake_complete", "_handshake_done_pending",
               "_host_cids", "_retire_connection_ids", "_streams_blocked_pending", "_ping_pending",
               "_probe_pending", "_datagrams_pending", "_quic_logger", "_loss", "_pacing_at", "_streams",
               "_streams_queue", "_remote_max_data", "_remote_max_data_used", "_is_client", "_logger",
               "_local_max_streams_bidi", "_local_max_streams_uni", "_state", "_close_at", "_close_pending",
               "_peer_cid", "_network_paths", "_configuration", "host_cid", "_spin_highest_pn", "_spin_bit",
               "_ack_eliciting_sent_since_receipt", "_ack_delay", "_handshake_confirmed", "_max_datagram_size",
               "_packet_number", "_remote_preferred_address")
# what QuicPacketSpace.__init__ sets, that LeanQuic reads
SPACE_NAMES = ("ack_at", "ack_queue", "discarded", "expected_packet_number", "largest_received_packet",
               "largest_received_time", "received_packets")


class LeanQuic(QuicConnection):
    """aioquic's QuicConnection, with steady-state 1-RTT packets written and read leanly."""

    _one_rtt = None   # (the _cryptos dict they came from, 1-RTT crypto pair, crypto stream, space, 0-RTT pair)

    @classmethod
    def adopt(cls, connection: QuicConnection) -> None:
        """Make `connection` (a plain QuicConnection, before or after its handshake) one of these."""
        if connection.__class__ is QuicConnection:
            connection.__class__ = cls

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, tuple]]:
        """aioquic's, for the first packet of a transmit in the steady state of a confirmed
        connection on a validated path: that packet is built in a `_OnePacket` (what aioquic's
        frame writers use of a QuicPacketBuilder, for one 1-RTT packet alone in its datagram)
        and registered as aioquic's `_flush_builder` registers it. Should aioquic's loop write
        more, its own method goes on from the next packet (the congestion window it sees
        already counts the first). Anything else takes aioquic's method."""
        paths = self._network_paths
        if (self._state is not _CONNECTED or self._close_pending or not self._handshake_confirmed
                or len(paths) != 1 or not paths[0].is_validated
                or (self._is_client and self._remote_preferred_address is not None)):
            return super().datagrams_to_send(now)
        network_path = paths[0]
        one_rtt = self._steady_one_rtt(network_path)
        if one_rtt is None:
            return super().datagrams_to_send(now)
        crypto, space = one_rtt
        loss = self._loss
        # aioquic's first loop turn: its pacing check, a packet, the frames the steady state has
        self._pacing_at = None
        if self._paced(space, now):
            return []
        size = self._max_datagram_size
        packet = _OnePacket(self._packet_number, 3 + len(self._peer_cid.cid), size,
                            min(size, loss.congestion_window - loss.bytes_in_flight), crypto.aead_tag_size)
        try:
            discarded = self._write_frames(packet, space, now)
        except QuicPacketBuilderStop:   # it is full: aioquic writes no more in this transmit
            return self._send(packet, crypto, space, network_path, now)
        if packet.packet_is_empty:
            if not discarded:
                return []   # aioquic's loop ends here too
            datagrams = []
        else:
            loss._pacer.update_after_send(now=now)
            datagrams = self._send(packet, crypto, space, network_path, now)
        if not self._next_turn_writes(space, now):
            return datagrams
        return datagrams + super().datagrams_to_send(now)

    def _paced(self, space, now: float) -> bool:
        """aioquic's pacing check at the start of each turn of its loop (skipped while an ACK
        is due): whether the pacer holds the turn back (`_pacing_at` arms its timer)."""
        if space.ack_at is None or space.ack_at >= now:
            self._pacing_at = self._loss._pacer.next_send_time(now=now)
            return self._pacing_at is not None
        return False

    def _next_turn_writes(self, space, now: float) -> bool:
        """Whether aioquic's loop, after a turn, would write in its next one: its pacing check
        (which may hold it back), then a packet started; if nothing could go in it, it ends."""
        return not self._paced(space, now) and self._more_to_write()

    def _write_frames(self, builder, space, now: float) -> bool:
        """One turn of aioquic's `_write_application` loop, with only the frames the steady
        state can have; whether a finished stream was discarded."""
        if space.ack_at is not None and space.ack_at <= now:
            self._write_ack_frame(builder=builder, space=space, now=now)
        self._write_connection_limits(builder=builder, space=space)
        for stream in self._streams.values():
            # aioquic's _write_stream_limits does nothing for a stream that passes this test
            # (most, every time: HTTP/3's control streams among them)
            local = stream.max_stream_data_local
            if local != stream.max_stream_data_local_sent or (local and stream.receiver.highest_offset * 2 > local):
                self._write_stream_limits(builder=builder, space=space, stream=stream)
        return self._write_streams(builder, space)

    def _send(self, packet: _OnePacket, crypto, space, network_path, now: float) -> list[tuple[bytes, tuple]]:
        """aioquic's `_end_packet` for a 1-RTT packet that starts its datagram (padding for
        the header-protection sample, the short header, encryption), then `_flush_builder`'s
        registration: the packet number moves on, loss recovery records the packet, the
        idle timer restarts on the first ack-eliciting packet since the last one received."""
        buf = packet.buffer
        size = buf.tell()
        header_size = packet.header_size
        if size <= header_size:
            return []   # nothing went in: aioquic cancels the packet
        sent = packet.sent
        padding = _FIRST_FRAME_ROOM + header_size - size
        if padding > 0:
            buf.push_bytes(bytes(padding))
            size += padding
            sent.in_flight = True
        number = sent.packet_number
        buf.seek(0)
        buf.push_uint8(PACKET_FIXED_BIT | (self._spin_bit << 5) | (crypto.key_phase << 2)
                       | (PACKET_NUMBER_SEND_SIZE - 1))
        buf.push_bytes(self._peer_cid.cid)
        buf.push_uint16(number & 0xFFFF)
        plain = buf.data_slice(0, size)
        datagram = crypto.encrypt_packet(plain[:header_size], plain[header_size:size], number)
        sent.sent_bytes = len(datagram)
        self._packet_number = number + 1
        sent.sent_time = now
        self._loss.on_packet_sent(packet=sent, space=space)
        if sent.is_ack_eliciting and not self._ack_eliciting_sent_since_receipt:
            self._close_at = now + self._idle_timeout()
            self._ack_eliciting_sent_since_receipt = True
        network_path.bytes_sent += len(datagram)
        return [(datagram, network_path.addr)]

    def _write_application(self, builder, network_path, now: float) -> None:
        one_rtt = self._steady_one_rtt(network_path)
        if one_rtt is None:
            return super()._write_application(builder, network_path, now)
        crypto, space = one_rtt
        # aioquic's pacing check, then one turn of its loop with only the frames the steady
        # state can have
        if self._paced(space, now):
            return
        builder.start_packet(_ONE_RTT_PACKET, crypto)
        discarded = self._write_frames(builder, space, now)
        if builder.packet_is_empty:
            if not discarded:
                return   # aioquic's loop ends here too
        else:
            self._loss._pacer.update_after_send(now=now)
        if not self._next_turn_writes(space, now):
            return
        # more to send (data that did not fit, MAX_STREAMS after discarded streams): aioquic's
        # loop carries nothing from one turn to the next, so its method continues from here
        super()._write_application(builder, network_path, now)

    def _steady_one_rtt(self, network_path):
        """(crypto pair, packet space) when aioquic's loop could write nothing but ACK,
        flow-control limits and STREAM frames; else None."""
        if not self._handshake_complete or self._quic_logger is not None:
            return None
        cached = self._one_rtt
        cryptos = self._cryptos
        if cached is None or cached[0] is not cryptos:   # first time, or aioquic built new ones
            cached = self._one_rtt_state()
        _, crypto, crypto_stream, space, _ = cached
        if (not crypto.send.is_valid() or not crypto_stream.sender.buffer_is_empty
                or self._handshake_done_pending or self._retire_connection_ids
                or self._streams_blocked_pending or self._ping_pending or self._probe_pending
                or self._datagrams_pending or network_path.remote_challenges
                or not (network_path.is_validated or network_path.local_challenge_sent)):
            return None
        for connection_id in self._host_cids:
            if not connection_id.was_sent:
                return None
        return crypto, space

    def _one_rtt_state(self) -> tuple:
        cryptos = self._cryptos
        self._one_rtt = (cryptos, cryptos[_ONE_RTT], self._crypto_streams[_ONE_RTT], self._spaces[_ONE_RTT],
                         cryptos[tls.Epoch.ZERO_RTT])
        return self._one_rtt

    def _write_streams(self, builder, space) -> bool:
        """aioquic's stream turn: STOP_SENDING, then RESET_STREAM or STREAM, per stream in its
        service order; finished streams discarded, served ones moved to the end. Whether any
        stream was discarded."""
        sent, discarded = set(), set()
        try:
            for stream in self._streams_queue:
                receiver, sender = stream.receiver, stream.sender
                if receiver.is_finished and sender.is_finished:   # QuicStream.is_finished
                    self._logger.debug("Stream %d discarded", stream.stream_id)
                    self._streams.pop(stream.stream_id)
                    if stream_is_client_initiated(stream.stream_id) != self._is_client:
                        self._stream_limit(stream.stream_id).value += 1   # the peer may open another
                    discarded.add(stream)
                    continue
                if receiver.stop_pending:
                    self._write_stop_sending_frame(builder=builder, stream=stream)
                if sender.reset_pending:
                    self._write_reset_stream_frame(builder=builder, stream=stream)
                elif not stream.is_blocked and not sender.buffer_is_empty:
                    used = self._write_stream_frame(
                        builder=builder, space=space, stream=stream,
                        max_offset=min(sender.highest_offset + self._remote_max_data
                                       - self._remote_max_data_used, stream.max_stream_data_remote))
                    self._remote_max_data_used += used
                    if used > 0:
                        sent.add(stream)
        finally:   # also when the packet filled up (QuicPacketBuilderStop), as aioquic does
            if sent or discarded:
                queue = [stream for stream in self._streams_queue if stream not in discarded and stream not in sent]
                queue.extend(sent)
                self._streams_queue = queue
        return bool(discarded)

    def _more_to_write(self) -> bool:
        """Whether aioquic's next loop turn would write a frame: MAX_STREAMS (raised as
        streams are discarded), or a stream with data it may send, or to stop, reset or
        discard. (MAX_DATA and MAX_STREAM_DATA are raised on receipt only: a turn that wrote
        them left nothing for the next.)"""
        for limit in (self._local_max_streams_bidi, self._local_max_streams_uni):
            # aioquic's _write_connection_limits: sent unless the peer still has more streams
            # left to open than the update would grant
            if limit.value != limit.sent and limit.sent - limit.used < limit.value - limit.sent:
                return True
        for stream in self._streams_queue:
            receiver, sender = stream.receiver, stream.sender
            if (receiver.is_finished and sender.is_finished) or receiver.stop_pending or sender.reset_pending:
                return True
            if not stream.is_blocked and not sender.buffer_is_empty:
                if len(sender._pending) or sender._pending_eof:
                    return True   # data (or a FIN) left: it did not fit, or flow control holds it
                # aioquic's next turn would ask this stream for a frame, get none, and only
                # then mark its buffer empty (QuicStreamSender.get_frame): marked here instead
                sender.buffer_is_empty = True
        return False

    # -- reading -------------------------------------------------------------------------------

    def receive_datagram(self, data: bytes, addr, now: float) -> None:
        """aioquic's, for a datagram of an established connection (one 1-RTT packet to the
        connection ID in use, from the active path's address) without what other packets
        need: the header parsed into a QuicHeader, the packet type, version and connection-ID
        lookups, the epoch dict lookups and the qlog and migration tests. Anything else
        takes aioquic's method."""
        network_path = self._steady_path(data, addr)
        if network_path is None:
            return super().receive_datagram(data, addr, now)
        if not network_path.is_validated:
            network_path.bytes_received += len(data)
        cached = self._one_rtt
        if cached is None or cached[0] is not self._cryptos:
            cached = self._one_rtt_state()
        _, crypto, _, space, zero_rtt = cached
        host_cid = self.host_cid
        try:
            plain_header, plain_payload, packet_number = crypto.decrypt_packet(
                data, 1 + len(host_cid), space.expected_packet_number)
        except CryptoError as exc:   # KeyUnavailableError too: the packet is dropped, as aioquic drops it
            self._logger.debug(exc)
            return
        if packet_number in space.received_packets:
            return   # a duplicate (RFC 9000 12.3)
        if plain_header[0] & _ONE_RTT_RESERVED_BITS:
            self.close(error_code=QuicErrorCode.PROTOCOL_VIOLATION, frame_type=QuicFrameType.PADDING,
                       reason_phrase="Reserved bits must be zero")
            return
        if packet_number > space.expected_packet_number:
            space.expected_packet_number = packet_number + 1
        if not self._is_client and zero_rtt.recv.is_valid():
            zero_rtt.recv.teardown()   # a server discards 0-RTT keys once 1-RTT packets arrive
        if packet_number > self._spin_highest_pn:
            spin_bit = get_spin_bit(plain_header[0])
            self._spin_bit = not spin_bit if self._is_client else spin_bit
            self._spin_highest_pn = packet_number
        context = QuicReceiveContext(epoch=_ONE_RTT, host_cid=host_cid, network_path=network_path,
                                     quic_logger_frames=None, time=now, version=None)
        try:
            is_ack_eliciting, _ = self._payload_received(context, plain_payload)
        except QuicConnectionError as exc:
            self._logger.warning(exc)
            self.close(error_code=exc.error_code, frame_type=exc.frame_type, reason_phrase=exc.reason_phrase)
            return   # aioquic returns here too: the state is closing (END_STATES or _close_pending)
        if self._state is not _CONNECTED or self._close_pending:
            return
        self._close_at = now + self._idle_timeout()
        self._ack_eliciting_sent_since_receipt = False
        # the connection ID in use, on the active path: no migration, no promotion
        if not space.discarded:
            if packet_number > space.largest_received_packet:
                space.largest_received_packet = packet_number
                space.largest_received_time = now
            space.ack_queue.add(packet_number)
            space.received_packets.add(packet_number)
            if len(space.ack_queue) > MAX_ACK_RANGES:
                space.ack_queue.shift()
            if is_ack_eliciting and space.ack_at is None:
                space.ack_at = now + self._ack_delay

    def _steady_path(self, data: bytes, addr):
        """The active network path when `data` is one 1-RTT packet of an established
        connection, to the connection ID in use, from that path's address; else None."""
        if (self._state is not _CONNECTED or not self._handshake_complete or self._quic_logger is not None
                or self._close_at is None or self._peer_cid.sequence_number is None
                or not data or data[0] & 0xC0 != _SHORT_HEADER):
            return None
        host_cid = self.host_cid
        if len(data) <= len(host_cid) + 1 or data[1:1 + len(host_cid)] != host_cid \
                or len(host_cid) != self._configuration.connection_id_length:
            return None
        paths = self._network_paths
        if not paths or paths[0].addr != addr:
            return None
        return paths[0]


class _OnePacket:
    """What aioquic's frame writers use of a QuicPacketBuilder (start_frame, the space left,
    the packet number), for one 1-RTT packet alone in its datagram: the checks and marks of
    `QuicPacketBuilder.start_frame` for that case, without its datagram and packet books."""

    __slots__ = ("buffer", "sent", "header_size", "_buffer_room", "_flight_room")

    quic_logger_frames = None   # the steady state has no qlog

    def __init__(self, packet_number: int, header_size: int, buffer_capacity: int, flight_capacity: int,
                 tag_size: int):
        self.sent = QuicSentPacket(epoch=_ONE_RTT, in_flight=False, is_ack_eliciting=False,
                                   is_crypto_packet=False, packet_number=packet_number,
                                   packet_type=_ONE_RTT_PACKET)
        self.header_size = header_size
        self.buffer = Buffer(buffer_capacity)
        self.buffer.seek(header_size)
        self._buffer_room = buffer_capacity - tag_size   # what frames may fill, less the AEAD tag
        self._flight_room = flight_capacity - tag_size

    @property
    def packet_number(self) -> int:
        return self.sent.packet_number

    @property
    def packet_is_empty(self) -> bool:
        return self.buffer.tell() <= self.header_size

    @property
    def remaining_buffer_space(self) -> int:
        return self._buffer_room - self.buffer.tell()

    @property
    def remaining_flight_space(self) -> int:
        return self._flight_room - self.buffer.tell()

    def start_frame(self, frame_type: int, capacity: int = 1, handler=None, handler_args=()) -> Buffer:
        buf = self.buffer
        at = buf.tell()
        if at <= self.header_size and capacity < _FIRST_FRAME_ROOM:
            capacity = _FIRST_FRAME_ROOM
        in_flight = frame_type not in NON_IN_FLIGHT_FRAME_TYPES
        if self._buffer_room - at < capacity or (in_flight and self._flight_room - at < capacity):
            raise QuicPacketBuilderStop
        buf.push_uint_var(frame_type)
        sent = self.sent
        if frame_type not in NON_ACK_ELICITING_FRAME_TYPES:
            sent.is_ack_eliciting = True
        if in_flight:
            sent.in_flight = True
        if frame_type == _CRYPTO_FRAME:
            sent.is_crypto_packet = True
        if handler is not None:
            sent.delivery_handlers.append((handler, handler_args))
        return buf
