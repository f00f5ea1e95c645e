"""Every refusal of the transport, counted by kind (and handed to `on_count`, the role's
metrics) and logged at most once per (client, kind) and `interval`, saying how many were not
logged since: a hostile client can make the server refuse thousands of times a second. The
table of last-logged times is bounded (the oldest entries go first).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

log = logging.getLogger("sdcp_fast.transport")


class Kind:
    """Refusal kinds (metric label values)."""

    MALFORMED = "malformed"                  # a request that breaks RFC 9113/9114: stream reset
    HEADERS_TOO_LARGE = "headers_too_large"  # 431, or the stream reset
    BODY_TOO_LARGE = "body_too_large"        # 413
    MEDIA_TYPE = "media_type"                # 415
    STREAM_LIMIT = "stream_limit"            # over max_concurrent_streams: REFUSED_STREAM
    RAPID_RESET = "rapid_reset"              # too many early resets: ENHANCE_YOUR_CALM
    REFUSED_REQUESTS = "refused_requests"    # too many 400/413/415/431 answers: ENHANCE_YOUR_CALM
    CALM_PENALTY = "calm_penalty"            # a client told to calm down came back too soon
    FLOW_STALLED = "flow_stalled"            # response stalled by flow control past send_timeout
    BODY_TIMEOUT = "body_timeout"            # 408
    HEADER_TIMEOUT = "header_timeout"        # preface or frame incomplete past header_timeout
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # TLS not done within handshake_timeout
    HANDSHAKE_DROPPED = "handshake_dropped"  # over max_handshakes: the oldest one was dropped
    CONNECTION_RATE = "connection_rate"      # a host opening connections faster than allowed
    IDLE = "idle"                            # closed after idle_timeout (counted, not an attack)
    CONNECTIONS = "connections"              # over max_connections
    CLIENT_CONNECTIONS = "client_connections"  # over max_connections_per_client
    TLS = "tls"                              # handshake refused (certificate, version, ...)
    CERTIFICATE = "certificate"              # the certificate policy refused the client
    ALPN = "alpn"                            # no h2 / h3 offered: no_application_protocol
    PROTOCOL = "protocol"                    # a connection error (GOAWAY) from the HTTP layer


class Refusals:
    def __init__(self, *, interval: float = 60.0, max_keys: int = 4096,
                 on_count: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.max_keys = max_keys
        self.on_count = on_count
        self.counts: Counter[str] = Counter()
        self._clock = clock
        self._logged: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()  # -> (when, muted)

    def refuse(self, kind: str, client: object, detail: str, *, level: int = logging.INFO) -> None:
        """Count one refusal of `kind` for `client` (an identity URI, or a peer address, of
        which the host counts: a flood of connections from one host is one client); log it
        unless this (client, kind) was logged less than `interval` seconds ago."""
        self.counts[kind] += 1
        if self.on_count is not None:
            try:
                self.on_count(kind)
            except Exception:  # metrics must never break serving
                log.exception("refusal counter failed")
        if isinstance(client, tuple) and client:   # a peer address: the host is the client
            client = client[0]
        key = (str(client), kind)
        now = self._clock()
        last = self._logged.get(key)
        if last is not None and now - last[0] < self.interval:
            self._logged[key] = (last[0], last[1] + 1)
            return
        muted = last[1] if last is not None else 0
        self._logged[key] = (now, 0)
        self._logged.move_to_end(key)
        while len(self._logged) > self.max_keys:
            self._logged.popitem(last=False)
        more = f" (and {muted} more since the last line)" if muted else ""
        log.log(level, "refused %s from %s: %s%s", kind, client, detail, more)
