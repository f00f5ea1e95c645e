"""HTTP/3 over QUIC on aioquic's public API, with mandatory client certificates, held to the
same limits as HTTP/2 (limits.py) through the same request lifecycle (lifecycle.py).

`H3Listener` hands each datagram to its connection by destination connection ID. Each
`H3ServerProtocol` asks for a client certificate and announces MAX_STREAMS
`max_concurrent_streams` (beyond it: STREAM_LIMIT_ERROR, RFC 9000 4.6); the handshake must
finish within `handshake_timeout`; a refused certificate closes the connection with its TLS
alert; HEADERS over `max_header_list` is answered 431 once its length is known (h3.TooLarge).
"""

from __future__ import annotations

import asyncio
import contextlib

from aioquic.buffer import Buffer
from aioquic.h3.connection import ErrorCode
from aioquic.quic import events, packet
from aioquic.tls import AlertDescription

from sdcp_fast.core.problems import Kind as ProblemKind
from sdcp_fast.core.problems import Problem

from . import compat
from .certpolicy import CertificateRejected
from .exchange import response_headers
from .h3 import Data, GoAway, H3Error, H3Streams, Headers, QuicDriver, TooLarge
from .http import Response
from .lifecycle import RequestLifecycle, Serving
from .refusals import Kind, log

CRYPTO_ERROR = 0x100   # + a TLS alert (RFC 9001 4.8)
_ALERTS = {CertificateRejected.MISSING: AlertDescription.certificate_required,
           CertificateRejected.EXPIRED: AlertDescription.certificate_expired}
_RESET_ONLY = frozenset({ErrorCode.H3_REQUEST_CANCELLED, ErrorCode.H3_REQUEST_REJECTED})


class H3Listener(asyncio.DatagramProtocol):
    """The UDP socket of the HTTP/3 server: datagrams to their connections."""

    def __init__(self, configuration, serving: Serving):
        self._configuration = configuration
        self._serving = serving
        self._protocols: dict[bytes, H3ServerProtocol] = {}   # by every connection ID in use
        self._transport: asyncio.DatagramTransport | None = None
        self._cid_length = configuration.connection_id_length

    def connection_made(self, transport) -> None:
        self._transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        if data and data[0] & 0xC0 == 0x40:   # a short header (RFC 9000 17.3): the ID follows
            protocol = self._protocols.get(data[1:1 + self._cid_length])
            if protocol is not None:
                protocol.datagram_received(data, addr)
            return
        try:
            header = packet.pull_quic_header(Buffer(data=data), host_cid_length=self._cid_length)
        except ValueError:
            return
        versions = self._configuration.supported_versions
        if header.version is not None and header.version not in versions:
            self._transport.sendto(packet.encode_quic_version_negotiation(
                source_cid=header.destination_cid, destination_cid=header.source_cid,
                supported_versions=versions), addr)
            return
        protocol = self._protocols.get(header.destination_cid)
        if protocol is None and header.packet_type == packet.QuicPacketType.INITIAL and len(data) >= 1200:
            quic = compat.client_certificate_quic()(
                configuration=self._configuration, original_destination_connection_id=header.destination_cid)
            protocol = H3ServerProtocol(quic, self._serving, self)
            self._protocols[header.destination_cid] = self._protocols[quic.host_cid] = protocol
        if protocol is not None:
            protocol.datagram_received(data, addr)

    def sendto(self, data: bytes, addr) -> None:
        self._transport.sendto(data, addr)

    def route(self, cid: bytes, protocol: H3ServerProtocol | None) -> None:
        if protocol is None:
            self._protocols.pop(cid, None)
        else:
            self._protocols[cid] = protocol

    def forget(self, protocol: H3ServerProtocol) -> None:
        for cid in [cid for cid, known in self._protocols.items() if known is protocol]:
            del self._protocols[cid]

    def close(self) -> None:
        for protocol in set(self._protocols.values()):
            protocol.abort()
        if self._transport is not None:
            self._transport.close()


class H3ServerProtocol(RequestLifecycle, QuicDriver):
    """One HTTP/3 connection."""

    PROTOCOL = "h3"
    MALFORMED = ErrorCode.H3_MESSAGE_ERROR
    UNPROCESSED = ErrorCode.H3_REQUEST_REJECTED   # RFC 9114 4.1.1: safe to retry

    def __init__(self, quic, serving: Serving, listener: H3Listener):
        QuicDriver.__init__(self, quic, listener.sendto)
        RequestLifecycle.__init__(self, serving)
        compat.set_max_streams_bidi(quic, serving.limits.max_concurrent_streams)
        self._listener = listener
        self._h3: H3Streams | None = None
        self._awaiting_headers: dict[int, asyncio.TimerHandle] = {}   # request streams begun, headers not whole
        self._highest_stream = -1
        self._ended = False
        self._written: list[int] = []   # answers written since the last transmit: watched once sent
        serving.handshake_started(self, self._drop, None)
        self._handshake_timer = self._loop.call_later(self._limits.handshake_timeout, self._handshake_overdue)

    def datagram_received(self, data: bytes, addr) -> None:
        if self._peer is None:
            self._peer = addr
            if not self._serving.may_connect(addr[0]):
                # dropped before any handshake work: the datagram is not even parsed
                self._count_refusal(Kind.CONNECTION_RATE, "new connections too fast")
                self._serving.handshake_ended(self)
                self._handshake_timer.cancel()
                self._listener.forget(self)
                return
        self.receive(data, addr)

    def quic_event(self, event) -> None:
        if isinstance(event, events.StreamDataReceived):
            if self._h3 is not None:
                self._on_stream_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.StreamReset | events.StopSendingReceived):
            if self._h3 is not None:
                self._h3.forget(event.stream_id)
            self._headers_arrived(event.stream_id)
            if self._on_reset(event.stream_id):
                # our side too, so that QUIC frees the stream (and gives the client its credit)
                self._reset(event.stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        elif isinstance(event, events.HandshakeCompleted):
            self._handshake_done()
        elif isinstance(event, events.ConnectionIdIssued):
            self._listener.route(event.connection_id, self)
        elif isinstance(event, events.ConnectionIdRetired):
            self._listener.route(event.connection_id, None)
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event)

    # ---- admission -----------------------------------------------------------------------
    def _handshake_done(self) -> None:
        self._handshake_timer.cancel()
        self._serving.handshake_ended(self)
        leaf, _ = compat.peer_certificates(self.quic)
        refusal = self._admit(leaf, self._serving.certificates.check)
        if refusal == Kind.CERTIFICATE:
            alert = _ALERTS.get(self._rejected.reason, AlertDescription.bad_certificate)
            self.quic.close(error_code=CRYPTO_ERROR + alert, frame_type=0, reason_phrase=str(self._rejected))
            self.transmit()
        elif refusal is not None:
            self._close(ErrorCode.H3_EXCESSIVE_LOAD, self._refusal)
        else:
            self._h3 = H3Streams(self.quic, is_client=False, max_field_section_size=self._limits.max_header_list)

    def _handshake_overdue(self) -> None:
        self._count_refusal(Kind.HANDSHAKE_TIMEOUT, f"handshake not done within {self._limits.handshake_timeout}s")
        self._drop()

    def _drop(self) -> None:
        """Over max_handshakes (the oldest makes room), or past handshake_timeout."""
        self._serving.handshake_ended(self)
        self._close(ErrorCode.H3_EXCESSIVE_LOAD, "handshake dropped")

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        self._ended = True
        self._handshake_timer.cancel()
        self._serving.handshake_ended(self)
        self._listener.forget(self)
        self.stop_timer()
        self._connection_over()
        for timer in self._awaiting_headers.values():
            timer.cancel()
        self._awaiting_headers.clear()
        if self.caller is None and self._rejected is None:
            reason = event.reason_phrase or f"error {event.error_code:#x}"
            kind = Kind.TLS
            if event.error_code == CRYPTO_ERROR + AlertDescription.decrypt_error:
                # the one signature a server checks is the client's CertificateVerify
                kind, reason = Kind.CERTIFICATE, "CertificateVerify signature does not match the certificate"
            self._count_refusal(kind, f"refused client {self._peer}: {reason}")
        elif event.error_code == packet.QuicErrorCode.STREAM_LIMIT_ERROR:
            self._count_refusal(Kind.STREAM_LIMIT, f"more than {self._limits.max_concurrent_streams} streams "
                                                   f"opened: closed ({event.reason_phrase})")
        elif event.reason_phrase == "Idle timeout":  # aioquic's own close
            self._count_refusal(Kind.IDLE, f"idle for {self._limits.idle_timeout}s: closed")
        else:
            log.debug("h3: connection from %s (%s) closed: %s", self._peer, self.caller,
                      event.reason_phrase or f"code {event.error_code:#x}")

    # ---- streams -------------------------------------------------------------------------
    def _on_stream_data(self, stream_id: int, data: bytes, ended: bool) -> None:
        try:
            events = self._h3.receive(stream_id, data, ended)
        except H3Error as exc:
            self._close(exc.code, str(exc))
            return
        if stream_id % 4 == 0 and stream_id > self._highest_stream:   # a new request stream
            self._highest_stream = stream_id
            if not events and not ended:   # its header block must be whole within header_timeout
                self._awaiting_headers[stream_id] = self._loop.call_later(
                    self._limits.header_timeout, self._headers_overdue, stream_id)
        elif events:   # a header block, or what follows one: the headers are no longer awaited
            self._headers_arrived(stream_id)
        if len(events) == 2 and events[0].__class__ is Headers and events[1].__class__ is Data \
                and events[1].ended and not events[0].ended:
            # a whole request: its body known with its headers
            self._on_headers(stream_id, events[0].headers, False, events[1].data)
            return
        for event in events:
            if event.__class__ is Data:
                self._on_body(stream_id, event.data, event.ended)
            elif event.__class__ is Headers:
                self._on_headers(stream_id, event.headers, event.ended)
            elif event.__class__ is TooLarge:
                self._refuse(stream_id, Problem(ProblemKind.HEADERS_TOO_LARGE,
                                                f"HEADERS frame of {event.size} bytes exceeds the limit of "
                                                f"{self._limits.max_header_list}"), request_complete=ended)
            elif event.__class__ is GoAway:
                self.goaway()

    def _headers_arrived(self, stream_id: int) -> None:
        timer = self._awaiting_headers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()

    def _headers_overdue(self, stream_id: int) -> None:
        """A request stream whose header block is still incomplete `header_timeout` after its
        first byte: reset it (it holds a stream of the client's limit and up to a header block)."""
        if self._awaiting_headers.pop(stream_id, None) is None:
            return
        self._count_refusal(Kind.HEADER_TIMEOUT,
                            f"stream {stream_id}: headers not complete within {self._limits.header_timeout}s")
        self._reset(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)

    # ---- the wire operations of the lifecycle --------------------------------------------
    def _write_answer(self, stream_id: int, response: Response, head: bool) -> None:
        if self._h3 is None or self._ended:
            return
        try:
            # aioquic queues the bytes and paces them by QUIC flow control, which covers the
            # HEADERS frame too: a response without content can stall as well
            self._h3.send(stream_id, response_headers(response), b"" if head else response.body)
        except Exception as exc:  # stream already reset or connection closed: nothing to answer
            log.debug("h3: could not answer stream %d: %s", stream_id, exc)
            return
        self._written.append(stream_id)
        self._send_answers()

    def _reset(self, stream_id: int, code: int) -> None:
        """Reset our side; STOP_SENDING too, unless the request is complete or the client
        ended it (a cancelled or rejected stream). What still arrives on it is dropped."""
        if self._h3 is not None:
            self._h3.forget(stream_id)
        try:
            self.quic.reset_stream(stream_id, code)
            if code not in _RESET_ONLY:
                self.quic.stop_stream(stream_id, code)
        except Exception as exc:  # already reset or ended
            log.debug("h3: could not reset stream %d: %s", stream_id, exc)
        self.transmit_soon()

    def _stop_upload(self, stream_id: int, overdue: bool) -> None:
        with contextlib.suppress(Exception):   # RFC 9114 4.1.1: the answer is complete
            self.quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        self.transmit_soon()

    def _end_connection(self, kind: str) -> None:
        if kind == "calm":
            self._close(ErrorCode.H3_EXCESSIVE_LOAD, self._calm_reason)
        else:
            self._close(ErrorCode.H3_NO_ERROR, "server stopping")

    def answer_pending(self) -> bool:
        return bool(self._tasks)

    def transmit(self) -> None:
        super().transmit()
        if self._written:
            written, self._written = self._written, []
            for stream_id in written:
                if compat.unsent(self.quic, stream_id):   # not all sent at once: watch it
                    self._loop.call_later(self._limits.send_timeout, self._check_sent, stream_id)

    def _check_sent(self, stream_id: int) -> None:
        """A response still not sent `send_timeout` after it was written (the client gives no
        flow-control credit): reset the stream, freeing what it holds."""
        if self._ended or not compat.unsent(self.quic, stream_id):
            return
        self._count_refusal(Kind.FLOW_STALLED, f"stream {stream_id}: not delivered within {self._limits.send_timeout}s")
        self._reset(stream_id, ErrorCode.H3_REQUEST_CANCELLED)

    # ---- closing -------------------------------------------------------------------------
    def abort(self) -> None:
        self._close(ErrorCode.H3_NO_ERROR, "server stopped")

    def _close(self, code: int, reason: str) -> None:
        if self._ended:
            return
        self.transmit()   # answers written this turn leave before the close
        self.quic.close(error_code=code, reason_phrase=reason)
        self.transmit()
