"""Every limit the SDCP servers enforce against hostile or broken clients, in one place.

`Limits` is the `[transport]` table of an instance's config (config.py uses this class as
its schema) and what `serve()` takes. Each limit refuses cleanly (a 4xx answer, a stream
reset, or a connection closed with a reason) and each refusal is counted and logged through
`Refusals` (refusals.py). The defaults suit a verifier serving drafters over long-lived
connections on a LAN; docs/TRANSPORT.md says why each is what it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DEFAULT_BODY_LIMITS = {
    # per resource class (the Router's `resource=`): small messages get small bodies
    "proposals": 64 << 10,
    "drafter": 64 << 10,
    "policy": 64 << 10,
    "output": 0,
    "status": 64 << 10,
    "events": 64 << 10,
}


@dataclass(frozen=True)
class Limits:
    # ---- bodies (decided from content-length, or as bytes arrive, before anything is kept)
    max_body: int = 1 << 20                  # any resource without its own entry below
    body_limits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_BODY_LIMITS))  # per resource class

    # ---- headers
    max_header_list: int = 16 << 10          # SETTINGS_MAX_HEADER_LIST_SIZE, advertised; 431 above

    # ---- streams, per connection
    max_concurrent_streams: int = 128        # advertised (HTTP/2 SETTINGS, QUIC MAX_STREAMS)
    max_early_resets: int = 200              # streams reset before their answer (or refused) ...
    early_reset_window_s: float = 10.0       # ... within this window: ENHANCE_YOUR_CALM
    max_refused_requests: int = 32           # requests answered 400/413/415/431 within the window: the same

    # ---- connections
    max_connections: int = 1024              # authenticated connections, all clients together
    max_connections_per_client: int = 32     # per certificate identity
    max_handshakes: int = 256                # handshakes in progress; the oldest is dropped first
    new_connections_per_host_s: float = 20.0  # new connections a host may open per second ...
    new_connections_burst: int = 100         # ... beyond a burst of this many: refused before TLS
    calm_penalty_s: float = 10.0             # a client told to calm down is refused this long

    # ---- timeouts (seconds)
    handshake_timeout: float = 5.0           # TCP accept -> TLS 1.3 handshake done
    header_timeout: float = 10.0             # h2: preface, any frame; h3: a header block; whole within this
    body_timeout: float = 30.0               # request headers -> end of the body (408)
    send_timeout: float = 30.0               # a response stalled by flow control this long: reset
    idle_timeout: float = 600.0              # no stream open this long: close (drafters reconnect)
    handler_timeout: float = 60.0            # the role's answer (503 after)

    # ---- HTTP/3 (QUIC flow control: bytes a client may have in flight)
    quic_max_data: int = 4 << 20             # per connection
    quic_max_stream_data: int = 1 << 20      # per stream

    def __post_init__(self) -> None:
        # entries given (a config's body_limits table) override the defaults, one by one
        object.__setattr__(self, "body_limits", {**DEFAULT_BODY_LIMITS, **self.body_limits})
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{f.name} must be >= 0, not {value}")
        if any(v < 0 for v in self.body_limits.values()):
            raise ValueError("body_limits must be >= 0")
        for name in ("body_timeout", "header_timeout", "handshake_timeout", "send_timeout",
                     "idle_timeout", "early_reset_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_concurrent_streams < 1 or self.max_connections < 1 or self.max_handshakes < 1 \
                or self.new_connections_burst < 1:
            raise ValueError("max_concurrent_streams, max_connections and max_handshakes must be >= 1")

    def body_limit(self, resource: str | None) -> int:
        """The body limit of a resource class (`max_body` when it has no entry, or is None)."""
        return self.body_limits.get(resource, self.max_body)
