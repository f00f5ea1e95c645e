"""Where the transport's libraries lack a public API SDCP needs: one shim each, its docstring
naming the upstream issue it waits for; the only module allowed a library's private names
(tests/transport/test_public_apis.py). A shim goes once its issue is resolved in range.
"""

from __future__ import annotations

import functools
from typing import Any

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
    (aioquic fixes it at 128, with no QuicConfiguration member; the issue to file: docs/TRANSPORT.md).
    `sent` too: aioquic raises the limit per closed stream only once the new value is ahead
    of what it believes was announced."""
    streams = quic._local_max_streams_bidi
    streams.value = streams.sent = count


def unsent(quic, stream_id: int) -> bool:
    """Whether data written on `stream_id` still waits to be sent (flow control), the stream
    neither finished nor reset (aioquic has no public look-up of a stream's send state; the
    issue to file: docs/TRANSPORT.md)."""
    stream = quic._streams.get(stream_id)
    return stream is not None and not stream.sender.buffer_is_empty and not stream.sender.is_finished
