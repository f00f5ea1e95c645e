"""Where the transport's libraries lack a public API SDCP needs: one shim each, its docstring
naming the upstream issue it waits for; the only module allowed a library's private names
(tests/transport/test_public_apis.py). A shim goes once its issue is resolved in range.
"""

from __future__ import annotations

import functools
from typing import Any

import jh2.connection
import jh2.events
import jh2.exceptions
from jh2.errors import ErrorCodes

# h2 remembers how each closed stream ended (so that a late frame on a stream it reset is a
# stream error), 65,536 per connection by default; a late frame comes within one round trip
# of the reset, so a few thousand are plenty (`MAX_CLOSED_STREAMS` is public h2 API)
H2_CLOSED_STREAMS_KEPT = 4096


class MalformedStream(jh2.events.Event):
    """Our event: `stream_id` was reset (PROTOCOL_ERROR) for `reason`; DATA bytes to credit back."""

    def __init__(self, stream_id: int, reason: str, flow_controlled_length: int = 0):
        self.stream_id = stream_id
        self.reason = reason
        self.flow_controlled_length = flow_controlled_length


class H2Connection(jh2.connection.H2Connection):
    """h2's connection with the closed-stream memory bounded (no shim: a public attribute)."""

    MAX_CLOSED_STREAMS = H2_CLOSED_STREAMS_KEPT


class H2StreamErrors(H2Connection):
    """h2's connection where a malformed request's error stays on its stream (jh2; h2 the
    same): RFC 9113 8.1.1 makes a malformed request (a content-length that is not a number,
    that conflicts with another, or that the body does not match) a *stream* error; h2 raises
    a connection error and sends GOAWAY, ending every other stream on the connection.
    Upstream: python-hyper/h2 issue 114 (content-length policing); the stream-error variant is
    not filed yet (the proposal: bench/RESULTS.md)."""

    def _receive_headers_frame(self, frame):
        try:
            return super()._receive_headers_frame(frame)
        except jh2.exceptions.ProtocolError as exc:
            if not self._on_open_stream(exc, frame.stream_id):
                raise
            return self._malformed(frame.stream_id, exc, 0)

    def _receive_data_frame(self, frame):
        try:
            return super()._receive_data_frame(frame)
        except jh2.exceptions.InvalidBodyLengthError as exc:
            return self._malformed(frame.stream_id, exc, frame.flow_controlled_length)

    def _on_open_stream(self, exc: jh2.exceptions.ProtocolError, stream_id: int) -> bool:
        """Whether `exc` concerns the message on `stream_id` alone: not a header block that
        would not decode (the shared HPACK state is lost then), not a limit of the connection."""
        if isinstance(exc, jh2.exceptions.DenialOfServiceError | jh2.exceptions.TooManyStreamsError):
            return False
        if exc.__cause__ is not None and not isinstance(exc.__cause__, ValueError):
            return False   # raised from the header block's decoding
        stream = self.streams.get(stream_id)
        return stream is not None and not stream.closed

    def _malformed(self, stream_id: int, exc: Exception, length: int):
        self.reset_stream(stream_id, ErrorCodes.PROTOCOL_ERROR)
        return [], [MalformedStream(stream_id, str(exc), length)]


# ---- aioquic (imported on first use: HTTP/3 is an optional extra) ------------------------

@functools.cache
def client_certificate_quic() -> type:
    """aioquic's QuicConnection whose server TLS context asks for a client certificate (its
    public API cannot: the flag is "for test purposes only", aioquic issue 541). aioquic then
    requires the client's CertificateVerify (proof of possession) but accepts an empty
    Certificate and checks no chain: server_h3.py applies the certificate policy once the
    handshake completes, and refuses a connection without one."""
    from aioquic.quic.connection import QuicConnection

    class ClientCertificateQuic(QuicConnection):
        def _initialize(self, peer_cid: bytes) -> None:
            super()._initialize(peer_cid)
            if not self.configuration.is_client:
                self.tls._request_client_certificate = True

    return ClientCertificateQuic


def peer_certificates(quic) -> tuple[Any, list[Any]]:
    """(leaf, intermediates) the peer presented in the TLS handshake, as aioquic parsed them;
    (None, []) if none (aioquic issue 541: no public accessor on either side)."""
    context = getattr(quic, "tls", None)
    if context is None:
        return None, []
    return context._peer_certificate, list(context._peer_certificate_chain)


def set_max_streams_bidi(quic, count: int) -> None:
    """The initial MAX_STREAMS (bidirectional) a server announces, before its first datagram
    (aioquic fixes it at 128, with no QuicConfiguration member; not filed upstream yet).
    `sent` too: aioquic raises the limit per closed stream only once the new value is ahead
    of what it believes was announced."""
    streams = quic._local_max_streams_bidi
    streams.value = streams.sent = count


def unsent(quic, stream_id: int) -> bool:
    """Whether data written on `stream_id` still waits to be sent (flow control), the stream
    neither finished nor reset (aioquic has no public look-up of a stream's send state; not
    filed upstream yet)."""
    stream = quic._streams.get(stream_id)
    return stream is not None and not stream.sender.buffer_is_empty and not stream.sender.is_finished
