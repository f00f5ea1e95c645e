"""Client-certificate authentication for aioquic's QUIC server (with quic_lean.py, where we reach inside it).

aioquic 1.7.2's TLS 1.3 server (`aioquic.tls.Context`) can send a CertificateRequest, but only
behind a private flag "for test purposes" (`_request_client_certificate`; aioquic issue 541),
it continues the handshake when the client answers with an empty Certificate (RFC 8446
4.4.2.4 allows a server to), and it never checks the client's chain against a CA. What it does
do right is proof of possession: a non-empty Certificate moves it to
SERVER_EXPECT_CERTIFICATE_VERIFY, and `_server_handle_certificate_verify` checks the client's
signature over the transcript with the certificate's public key before Finished is accepted.

`require_client_certificate(connection, policy)` changes one server connection, before its
first datagram, so that its TLS context
  1. requests a certificate (the private flag),
  2. refuses an empty Certificate with a certificate_required alert,
  3. checks the leaf with `CertificatePolicy` (certpolicy.py: the same policy as HTTP/2;
     expired -> certificate_expired, anything else -> bad_certificate),
  4. keeps aioquic's CertificateVerify check, and
  5. refuses Finished unless 2-4 all ran and passed (a guard against any other path to it).
Session resumption would skip the CertificateRequest, so it is refused outright: the server is
built without a session-ticket store and the guard checks that no ticket callback is set.

The change is per connection (the instance's class is swapped for a subclass that adds no
state of its own to __init__), never global. The hooks rely on private names, so
`check_aioquic()` (run when an HTTP/3 server starts or a client connects) checks the aioquic
version and the hooked names; a version this code was not reviewed against fails closed
(HTTP/3 will not start) rather than silently serving clients without authentication.
"""

from __future__ import annotations

import functools

import aioquic
from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic.connection import QuicConnection

from .certpolicy import CertificatePolicy
from .identity import CertificateRejected

REVIEWED_AIOQUIC_VERSIONS = ("1.7.2",)
_HOOKED_METHODS = (
    "_server_handle_certificate",
    "_server_handle_certificate_verify",
    "_server_handle_finished",
    "_check_certificate_verify_signature",
)
_READ_ATTRIBUTES = ("_request_client_certificate", "_peer_certificate", "_peer_certificate_chain")


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class UnsupportedAioquic(RuntimeError):
    pass


@functools.cache
def check_aioquic() -> None:
    """Refuse to run on an aioquic whose private TLS internals were not reviewed for these hooks."""
    if aioquic.__version__ not in REVIEWED_AIOQUIC_VERSIONS:
        raise UnsupportedAioquic(
            f"aioquic {aioquic.__version__} is not one of {REVIEWED_AIOQUIC_VERSIONS}: the HTTP/3 "
            "client-certificate hooks in sdcp_fast/transport/quic_mtls.py must be re-reviewed"
        )
    context = tls.Context(is_client=False)
    missing = [name for name in (*_HOOKED_METHODS, *_READ_ATTRIBUTES) if not hasattr(context, name)]
    if not hasattr(QuicConnection, "_initialize"):
        missing.append("QuicConnection._initialize")
    missing += _missing_lean_names()
    if missing:
        raise UnsupportedAioquic(f"aioquic lacks {missing}")


def _missing_lean_names() -> list[str]:
    """The private names quic_lean.py and server_h3.H3Server use (ACK timing, QPACK settings and streams,
    deferred transmit, the timer, the server's connection table)."""
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.h3.connection import H3Connection
    from aioquic.quic.configuration import QuicConfiguration

    connection = QuicConnection(configuration=QuicConfiguration(is_client=True))
    names = [f"QuicConnection.{name}" for name in ("_ack_delay", "_spaces", "_events")
             if not hasattr(connection, name)]
    # quic_packets.LeanQuic's (the packet spaces and crypto pairs exist once _initialize ran)
    from aioquic.quic.stream import QuicStreamSender

    from .quic_packets import READ_NAMES, SENDER_NAMES, SPACE_NAMES, STATE_NAMES
    connection.connect(("127.0.0.1", 4433), now=0.0)   # builds the spaces and crypto pairs; sends nothing
    names += [f"QuicConnection.{name}" for name in READ_NAMES if not hasattr(QuicConnection, name)]
    names += [f"QuicConnection().{name}" for name in STATE_NAMES if not hasattr(connection, name)]
    sender = QuicStreamSender(0, True)
    names += [f"QuicStreamSender().{name}" for name in SENDER_NAMES if not hasattr(sender, name)]
    space = connection._spaces[tls.Epoch.ONE_RTT]
    names += [f"QuicPacketSpace().{name}" for name in SPACE_NAMES if not hasattr(space, name)]
    names += [f"QuicConnectionProtocol.{name}" for name in ("_transmit_soon", "_process_events", "_handle_timer")
              if not hasattr(QuicConnectionProtocol, name)]
    # the attributes its __init__ sets (LeanAcks.transmit keeps aioquic's timer in them)
    names += [f"QuicConnectionProtocol().{name}" for name in ("_timer", "_timer_at", "_transmit_task", "_transport")
              if name not in QuicConnectionProtocol.__init__.__code__.co_names]
    # the attributes QuicServer's __init__ sets (server_h3.H3Server routes 1-RTT datagrams with them)
    from aioquic.asyncio.server import QuicServer
    names += [f"QuicServer().{name}" for name in ("_configuration", "_protocols")
              if name not in QuicServer.__init__.__code__.co_names]
    names += [f"H3Connection.{name}" for name in ("_get_local_settings", "_get_or_create_stream", "_encode_headers",
                                                  "_decode_headers", "_receive_stream_data", "_receive_request_or_push_data")
              if not hasattr(H3Connection, name)]
    h3 = H3Connection(connection)
    names += [f"H3Connection().{name}" for name in ("_stream", "_quic_logger", "_is_client", "_encoder", "_decoder",
                                                    "_encoder_bytes_sent", "_decoder_bytes_sent",
                                                    "_local_encoder_stream_id", "_local_decoder_stream_id",
                                                    "_received_settings")
              if not hasattr(h3, name)]
    return names


class _ClientAuthServerContext(tls.Context):
    """aioquic's server TLS context with mandatory, verified client certificates."""

    # set by require_client_certificate() on the instance
    sdcp_policy: CertificatePolicy
    sdcp_identity: str | None
    sdcp_rejection: CertificateRejected | None
    sdcp_possession_proven: bool

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        # aioquic parses the message; an empty one sends it straight to "expect Finished".
        super()._server_handle_certificate(input_buf)
        if self.state != tls.State.SERVER_EXPECT_CERTIFICATE_VERIFY or self._peer_certificate is None:
            self.sdcp_rejection = CertificateRejected(CertificateRejected.MISSING, "no client certificate")
            raise AlertCertificateRequired("client certificate required")
        try:
            self.sdcp_identity = self.sdcp_policy.check(self._peer_certificate)
        except CertificateRejected as exc:
            self.sdcp_rejection = exc
            if exc.reason == CertificateRejected.EXPIRED:
                raise tls.AlertCertificateExpired(str(exc)) from exc
            raise tls.AlertBadCertificate(str(exc)) from exc

    def _server_handle_certificate_verify(self, input_buf: Buffer) -> None:
        try:
            super()._server_handle_certificate_verify(input_buf)  # signature with the cert's key
        except tls.Alert:
            self.sdcp_rejection = CertificateRejected(
                CertificateRejected.UNTRUSTED, "CertificateVerify signature does not match the certificate"
            )
            self.sdcp_identity = None
            raise
        self.sdcp_possession_proven = True

    def _server_handle_finished(self, input_buf: Buffer, output_buf: Buffer) -> None:
        if (
            self.sdcp_identity is None
            or not self.sdcp_possession_proven
            or self.get_session_ticket_cb is not None
        ):
            raise AlertCertificateRequired("client authentication did not complete")
        super()._server_handle_finished(input_buf, output_buf)


def require_client_certificate(connection: QuicConnection, policy: CertificatePolicy) -> None:
    """Arrange for `connection`'s TLS context (made on its first datagram) to demand client auth."""
    if connection._is_client:
        raise ValueError("client certificates are requested by servers")
    initialize = connection._initialize

    def _initialize_with_client_auth(peer_cid: bytes) -> None:
        initialize(peer_cid)
        context = connection.tls
        context.__class__ = _ClientAuthServerContext
        context._request_client_certificate = True
        context.sdcp_policy = policy
        context.sdcp_identity = None
        context.sdcp_rejection = None
        context.sdcp_possession_proven = False

    connection._initialize = _initialize_with_client_auth  # type: ignore[method-assign]


def verified_identity(connection: QuicConnection) -> str | None:
    """The caller URI once the handshake completed with a verified client certificate."""
    context = getattr(connection, "tls", None)
    if not isinstance(context, _ClientAuthServerContext) or context.state != tls.State.SERVER_POST_HANDSHAKE:
        return None
    return context.sdcp_identity


def rejection(connection: QuicConnection) -> CertificateRejected | None:
    context = getattr(connection, "tls", None)
    return getattr(context, "sdcp_rejection", None)


def peer_certificates(connection: QuicConnection):
    """(leaf, intermediates) the peer presented, as aioquic parsed them; (None, []) before that."""
    context = connection.tls
    return context._peer_certificate, list(context._peer_certificate_chain)
