"""quic_packets.LeanQuic sends and reads exactly what aioquic's QuicConnection sends and reads.

Two connection pairs, one of plain aioquic connections and one of LeanQuic connections, are
driven by the same script in memory, on the same clock. Their keys and connection IDs differ,
so after every step what is compared is what neither depends on: the plaintext of every packet
sent (its number and every frame), the events each end reads, and each end's bookkeeping (loss
recovery, ACK state, flow control, stream limits and service order, idle timer, spin bit).
"""

from __future__ import annotations

import ssl

import pytest
from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from sdcp_fast.transport.certs import make_ca
from sdcp_fast.transport.quic_packets import LeanQuic

CLIENT_ADDR, SERVER_ADDR = ("10.0.0.1", 50000), ("10.0.0.2", 4433)
_CA = make_ca("quic-packets test")


class Pair:
    """A client and a server connection in memory, on one clock, recording what each encrypts."""

    def __init__(self, lean: bool, **windows: int):
        """`windows`: flow-control windows for both ends (max_data, max_stream_data)."""
        self.windows = windows
        server_config = QuicConfiguration(is_client=False, alpn_protocols=["h3"], **windows)
        server_config.certificate, server_config.private_key = _CA.cert, _CA.key
        client_config = QuicConfiguration(is_client=True, alpn_protocols=["h3"], verify_mode=ssl.CERT_NONE,
                                          server_name="localhost", **windows)
        self.now = 1000.0
        self.client = QuicConnection(configuration=client_config)
        if lean:
            LeanQuic.adopt(self.client)
        self.server: QuicConnection | None = None
        self.lean = lean
        self.sent: dict[str, list] = {"client": [], "server": []}
        self.events: dict[str, list] = {"client": [], "server": []}
        self.client.connect(SERVER_ADDR, now=self.now)
        self.settle()
        assert self.client._handshake_complete and self.server._handshake_complete
        for side in ("client", "server"):
            self._record_encryption(side)
        self.sent = {"client": [], "server": []}
        self.events = {"client": [], "server": []}
        # the handshake's packets differ in size between pairs (ECDSA signatures vary in length),
        # so the congestion windows grown from them do too: compared from here on
        self.cwnd_at_start = {side: self.end(side)._loss.congestion_window for side in ("client", "server")}
        self.path_bytes_at_start = {side: self._path_bytes(side) for side in ("client", "server")}

    def same_windows(self, congestion_window: int) -> None:
        """Both ends' congestion windows set to one size (the pairs' differ by a few bytes, from
        their handshakes): for scripts that fill them to the byte."""
        for side in ("client", "server"):
            self.end(side)._loss._cc.congestion_window = congestion_window
            self.cwnd_at_start[side] = congestion_window

    def _path_bytes(self, side: str) -> list[tuple[int, int]]:
        return [(path.bytes_received, path.bytes_sent) for path in self.end(side)._network_paths]

    def _path_bytes_since_start(self, side: str) -> list[tuple[int, int]]:
        """Per path now, what it received and sent since the handshake (a path opened since: all)."""
        start = self.path_bytes_at_start[side]
        return [(received - start[n][0], sent - start[n][1]) if n < len(start) else (received, sent)
                for n, (received, sent) in enumerate(self._path_bytes(side))]

    def end(self, side: str) -> QuicConnection:
        return self.client if side == "client" else self.server

    def _record_encryption(self, side: str) -> None:
        crypto = self.end(side)._cryptos[tls.Epoch.ONE_RTT]
        encrypt, sent = crypto.encrypt_packet, self.sent

        def recording(plain_header: bytes, plain_payload: bytes, packet_number: int) -> bytes:
            sent[side].append((packet_number, plain_payload))
            return encrypt(plain_header, plain_payload, packet_number)

        crypto.encrypt_packet = recording

    def transmit(self, side: str, *, to_addr=None) -> list[bytes]:
        """What `side` sends now (datagrams), delivered to the other end."""
        sender = self.end(side)
        datagrams = [data for data, _ in sender.datagrams_to_send(now=self.now)]
        for data in datagrams:
            self.deliver("server" if side == "client" else "client", data, from_addr=to_addr)
        return datagrams

    def deliver(self, side: str, data: bytes, *, from_addr=None) -> None:
        if side == "server":
            if self.server is None:
                config = QuicConfiguration(is_client=False, alpn_protocols=["h3"], **self.windows)
                config.certificate, config.private_key = _CA.cert, _CA.key
                self.server = QuicConnection(
                    configuration=config, original_destination_connection_id=self.client.original_destination_connection_id)
                if self.lean:
                    LeanQuic.adopt(self.server)
            self.server.receive_datagram(data, from_addr or CLIENT_ADDR, now=self.now)
        else:
            self.client.receive_datagram(data, from_addr or SERVER_ADDR, now=self.now)
        self._read_events(side)

    def _read_events(self, side: str) -> None:
        connection = self.end(side)
        while (event := connection.next_event()) is not None:
            fields = {k: v for k, v in vars(event).items() if k not in ("peer_cid", "host_cid", "connection_id")}
            self.events[side].append((type(event).__name__, fields))

    def settle(self, *, steps: int = 200, step: float = 0.001) -> None:
        """Exchange until neither end has anything to send, the clock moving on and timers firing."""
        for _ in range(steps):
            moved = False
            for side in ("client", "server"):
                connection = self.end(side)
                if connection is None:
                    continue
                timer = connection.get_timer()
                if timer is not None and timer <= self.now:
                    connection.handle_timer(now=self.now)
                    self._read_events(side)
                moved |= bool(self.transmit(side))
            if not moved and self.server is not None and all(
                    (t := self.end(s).get_timer()) is None or t > self.now + 0.05 for s in ("client", "server")):
                return
            self.now += step

    def state(self, side: str) -> dict:
        connection = self.end(side)
        space = connection._spaces[tls.Epoch.ONE_RTT]
        loss = connection._loss
        return {
            "packet_number": connection._packet_number,
            "bytes_in_flight": loss.bytes_in_flight, "cwnd grown": loss.congestion_window - self.cwnd_at_start[side],
            # bytes sent and received on each path (the anti-amplification books), since the handshake
            "path bytes": self._path_bytes_since_start(side),
            "sent_packets": sorted(space.sent_packets), "ack_eliciting_in_flight": space.ack_eliciting_in_flight,
            "ack_at": space.ack_at, "ack_queue": [(r.start, r.stop) for r in space.ack_queue],
            "expected": space.expected_packet_number, "largest": space.largest_received_packet,
            "largest_time": space.largest_received_time,
            "received": (space.received_packets._lower, sorted(space.received_packets._received)),
            "close_at": connection._close_at, "state": connection._state,
            "ack_eliciting_sent": connection._ack_eliciting_sent_since_receipt,
            "spin": (connection._spin_bit, connection._spin_highest_pn),
            "pacing_at": connection._pacing_at, "pacer evaluated": loss._pacer.evaluation_time,
            "pacer bucket": loss._pacer.bucket_time,
            "data": (connection._remote_max_data_used, connection._local_max_data.used,
                     connection._local_max_data.value, connection._local_max_data.sent),
            "stream_limits": [(limit.value, limit.sent, limit.used) for limit in
                              (connection._local_max_streams_bidi, connection._local_max_streams_uni)],
            "queue": [stream.stream_id for stream in connection._streams_queue],
            "streams": {stream_id: (stream.sender.buffer_is_empty, stream.sender.highest_offset,
                                    stream.sender.is_finished, stream.receiver.highest_offset,
                                    stream.max_stream_data_local, stream.max_stream_data_local_sent,
                                    stream.is_blocked)
                        for stream_id, stream in connection._streams.items()},
        }


def _both(step):
    """Run `step(pair)` on a plain and a lean pair; after it everything compared must agree."""
    def run(plain: Pair, lean: Pair):
        step(plain)
        step(lean)
        for side in ("client", "server"):
            assert lean.sent[side] == plain.sent[side], f"{side} sent other packets"
            assert lean.events[side] == plain.events[side], f"{side} read other events"
            lean_state, plain_state = lean.state(side), plain.state(side)
            # the pacer's rate follows the congestion window, a byte apart between the pairs
            assert lean_state.pop("pacer bucket") == pytest.approx(plain_state.pop("pacer bucket"), rel=1e-3, abs=1e-9)
            assert lean_state == plain_state, f"{side} keeps other books"
    return run


@pytest.fixture
def pairs(monkeypatch):
    _one_stream_order(monkeypatch)
    return Pair(lean=False), Pair(lean=True)


def _one_stream_order(monkeypatch):
    # aioquic moves the streams served in one packet to the end of its service order in the
    # order of a set of them (QuicConnection._write_application), which follows their ids in
    # memory: different in the two pairs. Hashed by stream ID, both pairs get one order.
    from aioquic.quic.stream import QuicStream

    monkeypatch.setattr(QuicStream, "__hash__", lambda stream: hash(stream.stream_id))


def _round(pair: Pair, body: bytes = b"q" * 120, answer: bytes = b"a" * 90, *, think: float = 0.0003):
    """A request and its answer on a new stream, as an SDCP round sends them."""
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(stream_id, body, end_stream=True)
    pair.transmit("client")
    pair.now += think
    pair.server.send_stream_data(stream_id, answer, end_stream=True)
    pair.transmit("server")
    pair.now += think


def test_rounds_send_and_read_the_same_packets(pairs):
    plain, lean = pairs
    for n in range(40):
        # ACKs due now and then (the lean ACK timing of quic_lean.LeanAcks makes them ride on data)
        def step(pair, n=n):
            if n % 3 == 0:
                pair.now += 0.03   # past the ACK delay: the next packet carries an ACK
            _round(pair)
        _both(step)(plain, lean)
    _both(lambda pair: pair.settle())(plain, lean)


def test_many_streams_in_one_transmit_and_bodies_that_need_several_packets(pairs):
    plain, lean = pairs

    def several(pair):
        ids = []
        for size in (10, 2000, 50, 7000, 1):
            stream_id = pair.client.get_next_available_stream_id()
            pair.client.send_stream_data(stream_id, bytes([size % 251]) * size, end_stream=True)
            ids.append(stream_id)
        pair.transmit("client")
        for stream_id in ids:
            pair.server.send_stream_data(stream_id, b"r" * 3000, end_stream=True)
        pair.transmit("server")
        pair.settle()

    for _ in range(3):
        _both(several)(plain, lean)


def test_flow_control_and_congestion_hold_data_back_alike(pairs):
    plain, lean = pairs

    def upload(pair):
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"u" * 1_500_000, end_stream=True)   # beyond a stream's window
        pair.transmit("client")   # the congestion window stops the packets

    _both(upload)(plain, lean)
    _both(lambda pair: pair.settle(steps=2000))(plain, lean)


def test_a_transmit_that_starts_with_the_congestion_window_nearly_full_alike(pairs):
    """The first packet of a transmit gets only the room left in the congestion window: a
    STREAM frame cut to it, or none, with an ACK (not counted in flight) still sent."""
    plain, lean = pairs

    def congested(pair):
        client, server = pair.client, pair.server
        pacer = client._loss._pacer   # not paced: the window alone holds the client back
        pacer.packet_time = None
        pair.same_windows(13_000)
        upload = client.get_next_available_stream_id()
        client.send_stream_data(upload, b"u" * 400_000, end_stream=True)
        pair.transmit("client")   # stops with less than a packet's room left in the window
        assert client._loss.congestion_window - client._loss.bytes_in_flight < 1200
        server.send_stream_data(upload, b"early answer", end_stream=False)
        pair.transmit("server")   # not ACKing the upload yet; the client owes an ACK
        for n in range(6):
            pair.now += 0.03      # the client's ACK is due
            pacer.packet_time = None
            stream_id = client.get_next_available_stream_id()
            client.send_stream_data(stream_id, b"r" * (40 + 300 * n), end_stream=True)
            pair.transmit("client")
            server.send_stream_data(upload, b"more" * n, end_stream=False)
            pair.transmit("server")
        pair.settle(steps=2000)

    _both(congested)(plain, lean)
    for _ in range(5):
        _both(_round)(plain, lean)


@pytest.mark.parametrize("owed", ["MAX_DATA", "MAX_STREAM_DATA"])
def test_flow_control_updates_owed_with_the_congestion_window_full_alike(monkeypatch, owed):
    """MAX_DATA and MAX_STREAM_DATA are counted in flight: owed while the client's window is
    full, the first packet holds its ACK and then has no room for them (the packet ends, and
    nothing more is written in that transmit; a stream's raised limit goes out later)."""
    _one_stream_order(monkeypatch)
    windows = dict(max_data=20_000 if owed == "MAX_DATA" else 1_000_000, max_stream_data=16_000)
    plain, lean = Pair(lean=False, **windows), Pair(lean=True, **windows)

    def owing(pair):
        client, server = pair.client, pair.server
        pacers = [end._loss._pacer for end in (client, server)]

        def unpaced():   # the congestion windows alone hold the ends back
            for pacer in pacers:
                pacer.packet_time = None

        unpaced()
        pair.same_windows(13_000)
        upload = client.get_next_available_stream_id()
        client.send_stream_data(upload, b"u" * 15_000, end_stream=False)
        second = client.get_next_available_stream_id()
        client.send_stream_data(second, b"v" * 15_000, end_stream=False)
        pair.transmit("client")
        server.send_stream_data(upload, b"d" * 12_000, end_stream=False)   # it uses up the client's windows
        pair.transmit("server")
        if owed == "MAX_DATA":
            assert client._local_max_data.used * 2 > client._local_max_data.value
        else:
            assert client._local_max_data.used * 2 < client._local_max_data.value
            assert any(stream.receiver.highest_offset * 2 > stream.max_stream_data_local
                       for stream in client._streams.values())
        pair.now += 0.03   # the client's ACK is due
        unpaced()
        assert client._loss.congestion_window == client._loss.bytes_in_flight
        pair.transmit("client")
        pair.now += 0.03
        pair.transmit("server")   # its ACK, now due: room in the client's window again
        unpaced()
        pair.transmit("client")   # what did not fit goes now
        pair.settle(steps=2000)

    _both(owing)(plain, lean)
    for _ in range(3):
        _both(_round)(plain, lean)


def test_streams_discarded_in_a_transmit_with_nothing_else_to_send_raise_max_streams_alike(pairs):
    """A server transmit whose only work is discarding finished streams: the packet stays
    empty, and aioquic's next turn announces MAX_STREAMS, which the discards just made due."""
    plain, lean = pairs

    def many_then_finished(pair):
        client, server = pair.client, pair.server
        streams = []
        for _ in range(70):   # open, not yet finished: more than half the server's limit in use
            stream_id = client.get_next_available_stream_id()
            client.send_stream_data(stream_id, b"q" * 20, end_stream=False)
            streams.append(stream_id)
        pair.transmit("client")
        for stream_id in streams:
            server.send_stream_data(stream_id, b"a" * 10, end_stream=True)
        pair.transmit("server")
        pair.now += 0.03
        pair.transmit("server")   # its ACK of the requests, due now
        pair.transmit("client")   # its ACK of the answers
        for stream_id in streams:
            client.send_stream_data(stream_id, b"", end_stream=True)
        pair.transmit("client")   # the requests end: every server stream is finished
        sent_before = server._local_max_streams_bidi.sent
        pair.transmit("server")   # nothing due but the discards
        assert server._local_max_streams_bidi.sent > sent_before   # MAX_STREAMS went out
        pair.settle()

    _both(many_then_finished)(plain, lean)


def test_a_path_not_yet_validated_limits_what_is_sent_alike(pairs):
    """After the client moves to another address, the server may send three times what it
    received there until the path is validated (RFC 9000 8.1): a big answer waits for that."""
    plain, lean = pairs

    def moved(pair):
        _round(pair)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"m" * 40, end_stream=True)
        pair.transmit("client", to_addr=("10.0.0.9", 50001))
        pair.server.send_stream_data(stream_id, b"A" * 6000, end_stream=True)
        pair.transmit("server")   # the path challenge and what the limit lets through
        pair.now += 0.001
        pair.transmit("server")   # the client's answer to the challenge has not come: no more
        pair.settle()

    _both(moved)(plain, lean)


def test_resets_stops_and_discarded_streams_raise_limits_alike(pairs):
    plain, lean = pairs

    def churn(pair):
        for n in range(12):
            stream_id = pair.client.get_next_available_stream_id()
            pair.client.send_stream_data(stream_id, b"x" * 30, end_stream=n % 3 != 0)
            pair.transmit("client")
            if n % 3 == 0:
                pair.client.reset_stream(stream_id, 0x10C)
                pair.server.stop_stream(stream_id, 0x10C)
            else:
                pair.server.send_stream_data(stream_id, b"y" * 20, end_stream=True)
            pair.transmit("server")
            pair.transmit("client")
            pair.now += 0.03

    for _ in range(20):   # far enough for MAX_STREAMS updates
        _both(churn)(plain, lean)
    _both(lambda pair: pair.settle())(plain, lean)


def test_a_pacer_with_room_for_one_packet_holds_the_next_turn_back_alike(pairs):
    plain, lean = pairs

    def paced(pair):
        for side in ("client", "server"):   # room for exactly one packet now, then a wait
            pacer = pair.end(side)._loss._pacer
            pacer.packet_time, pacer.bucket_max = 0.002, 0.004
            pacer.bucket_time, pacer.evaluation_time = 0.002, pair.now
        _round(pair, think=0.0)
        assert pair.client._pacing_at is not None   # the turn after the packet was held back

    _both(paced)(plain, lean)
    _both(lambda pair: pair.settle())(plain, lean)


def test_pings_key_updates_and_new_connection_ids_take_aioquics_path_alike(pairs):
    plain, lean = pairs

    def unusual(pair):
        pair.client.send_ping(7)
        _round(pair)
        pair.client.request_key_update()
        _round(pair)
        _round(pair)
        pair.server.send_ping(8)
        _round(pair)
        pair.settle()

    _both(unusual)(plain, lean)


def test_duplicates_corruption_and_another_address_are_handled_alike(pairs):
    plain, lean = pairs

    def hostile(pair):
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"q" * 100, end_stream=True)
        (datagram,) = pair.client.datagrams_to_send(now=pair.now)
        data = datagram[0]
        pair.deliver("server", data)
        pair.deliver("server", data)                                       # a duplicate: dropped
        pair.deliver("server", data[:-1] + bytes([data[-1] ^ 1]))          # fails authentication: dropped
        pair.deliver("server", data[:5])                                   # too short: dropped
        pair.server.send_stream_data(stream_id, b"a" * 50, end_stream=True)
        pair.transmit("server")
        _round(pair)
        # the client moves to another address: the server validates the new path (aioquic's path)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(stream_id, b"m" * 40, end_stream=True)
        pair.transmit("client", to_addr=("10.0.0.9", 50001))
        pair.settle()

    _both(hostile)(plain, lean)


def _crafted(pair: Pair, first_byte: int, payload: bytes) -> bytes:
    """A 1-RTT packet from the client with our own first octet and frames, properly encrypted."""
    client = pair.client
    number = client._packet_number
    client._packet_number += 1
    header = bytes([first_byte]) + client._peer_cid.cid + (number & 0xFFFF).to_bytes(2, "big")
    return client._cryptos[tls.Epoch.ONE_RTT].encrypt_packet(header, payload, number)


@pytest.mark.parametrize("first_byte, payload", [
    (0x40 | 0x18 | 0x01, b"\x01" + bytes(4)),   # reserved bits set: PROTOCOL_VIOLATION
    (0x40 | 0x01, b"\x1f" + bytes(4)),          # an unknown frame type: FRAME_ENCODING_ERROR
    (0x40 | 0x01, b"\x0a\x08\x40\x64xx"),      # a STREAM frame shorter than its length: FRAME_ENCODING_ERROR
])
def test_a_malformed_packet_closes_the_connection_alike(pairs, first_byte, payload):
    plain, lean = pairs

    def malformed(pair):
        _round(pair)
        pair.deliver("server", _crafted(pair, first_byte, payload))
        assert pair.server._close_pending
        pair.settle()

    _both(malformed)(plain, lean)


def test_a_closed_connection_reads_and_sends_alike(pairs):
    plain, lean = pairs

    def close(pair):
        _round(pair)
        pair.server.close(error_code=0x100, reason_phrase="bye")
        pair.transmit("server")
        stream_id = pair.client.get_next_available_stream_id() if pair.client._state.name == "CONNECTED" else None
        if stream_id is not None:
            pair.client.send_stream_data(stream_id, b"late", end_stream=True)
        pair.transmit("client")
        pair.settle()

    _both(close)(plain, lean)


def test_the_lean_paths_are_taken(pairs):
    """Not a test of equality: that the shortcuts are in use where they should be (each
    transmit's packet built in a _OnePacket, not in aioquic's builder; datagrams read without
    aioquic's header parse)."""
    from aioquic.quic import connection as aioquic_connection

    from sdcp_fast.transport import quic_packets

    _, lean = pairs
    started, lean_packets, parsed = [], [], []
    start_packet = aioquic_connection.QuicPacketBuilder.start_packet
    one_packet = quic_packets._OnePacket.__init__
    pull_header = aioquic_connection.pull_quic_header

    def counting_start(builder, *args, **kwargs):
        started.append(1)
        return start_packet(builder, *args, **kwargs)

    def counting_one_packet(packet, *args, **kwargs):
        lean_packets.append(1)
        return one_packet(packet, *args, **kwargs)

    def counting_pull(*args, **kwargs):
        parsed.append(1)
        return pull_header(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aioquic_connection.QuicPacketBuilder, "start_packet", counting_start)
        patch.setattr(quic_packets._OnePacket, "__init__", counting_one_packet)
        patch.setattr(aioquic_connection, "pull_quic_header", counting_pull)
        for _ in range(10):
            _round(lean)
    assert len(lean_packets) == 20   # one packet per transmit, two transmits per round
    assert started == []
    assert parsed == []
