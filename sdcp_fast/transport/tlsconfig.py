"""TLS material of one instance and the contexts built from it: TLS 1.3 only, mutual auth."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from .certpolicy import uri_identity
from .certs import CA_CERT_FILE, instance_file_name

H2_ALPN = "h2"
H3_ALPN = "h3"


@dataclass(frozen=True)
class TLSConfig:
    """PEM files: this instance's certificate and key, and the CA that every peer must chain to."""

    cert: Path
    key: Path
    ca: Path

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = Path(getattr(self, name))
            object.__setattr__(self, name, path)
            if not path.is_file():
                raise FileNotFoundError(f"TLSConfig.{name}: no such file {path}")

    @classmethod
    def for_instance(cls, directory: str | Path, uri: str) -> TLSConfig:
        """The files `make_certs(directory, [uri, ...])` wrote for `uri`."""
        root = Path(directory)
        name = instance_file_name(uri)
        return cls(root / f"{name}.pem", root / f"{name}.key", root / CA_CERT_FILE)

    @property
    def identity(self) -> str:
        """This instance's URI: the URI SAN of its own certificate."""
        return uri_identity(x509.load_pem_x509_certificate(self.cert.read_bytes()))

    def server_ssl_context(self) -> ssl.SSLContext:
        """TCP server: TLS 1.3 only, client certificate from the CA required, ALPN h2."""
        context = self._ssl_context(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED
        # Resumed sessions would skip the CertificateRequest; every connection authenticates anew.
        context.num_tickets = 0
        context.options |= ssl.OP_NO_TICKET
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """TCP client: TLS 1.3 only, presents our certificate, verifies the server against the CA."""
        return self._ssl_context(ssl.PROTOCOL_TLS_CLIENT)

    def _ssl_context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(cafile=self.ca)
        context.set_alpn_protocols([H2_ALPN])
        return context

    def quic_configuration(self, *, is_client: bool, idle_timeout: float):
        """aioquic configuration (QUIC is TLS 1.3). The client leaves server_name unset (aioquic
        would check it with service_identity, which cannot parse URI SANs with a port): aioquic
        checks the chain and CertificateVerify, the client the host name (verify_server)."""
        from aioquic.quic.configuration import QuicConfiguration

        config = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[H3_ALPN],
            idle_timeout=idle_timeout,
            max_datagram_frame_size=None,
        )
        config.load_cert_chain(self.cert, self.key)
        if not is_client:
            return config
        # The client checks the server's chain and name against our CA only (no system roots).
        config.verify_mode = ssl.CERT_REQUIRED
        config.load_verify_locations(cafile=str(self.ca))
        return config
