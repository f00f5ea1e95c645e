"""Per-connection budgets of misbehaviour, shared by the HTTP/2 and HTTP/3 servers.

Two things cost a hostile client almost nothing and the server a request each: streams
reset (or refused) before their answer, the 2023 rapid-reset attack, and requests the
server must refuse as malformed or over a limit (400, 413, 415, 431), for which it has
still read and decoded a header block or a body. A well-behaved client does either rarely.
Past its budget within the window the connection ends with ENHANCE_YOUR_CALM /
H3_EXCESSIVE_LOAD and the client's identity is refused for `calm_penalty_s`
(Serving.calm_down), so reconnecting does not buy a fresh budget at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .limits import Limits
from .refusals import Kind

# answers that say the request itself was bad: a well-behaved client does not send them
REFUSED_STATUSES = frozenset({400, 413, 415, 431})


@dataclass
class Strikes:
    """Strikes within a fixed window that starts at the first strike after the last one ended."""

    limit: int
    window_s: float
    start: float = 0.0
    count: int = 0

    def add(self, now: float) -> bool:
        """Count one strike at `now`; True when it is one over the limit (the connection ends)."""
        if now - self.start > self.window_s:
            self.start, self.count = now, 0
        self.count += 1
        return self.count == self.limit + 1


class ConnectionStrikes:
    """A connection's two budgets; `early_reset` and `refused` name the limit that was
    passed (a refusal kind and a detail for the log) or return None."""

    def __init__(self, limits: Limits):
        self._window = limits.early_reset_window_s
        self._resets = Strikes(limits.max_early_resets, self._window)
        self._refused = Strikes(limits.max_refused_requests, self._window)

    def early_reset(self, now: float, stream_id: int, detail: str) -> tuple[str, str] | None:
        if not self._resets.add(now):
            return None
        return Kind.RAPID_RESET, (f"{self._resets.count} streams reset or refused before their answer within "
                                  f"{self._window:g}s (last: stream {stream_id}, {detail})")

    def refused(self, now: float, stream_id: int, status: int) -> tuple[str, str] | None:
        if status not in REFUSED_STATUSES or not self._refused.add(now):
            return None
        return Kind.REFUSED_REQUESTS, (f"{self._refused.count} requests refused as malformed or over a limit "
                                       f"within {self._window:g}s (last: stream {stream_id}, {status})")


class CountsStrikes:
    """The counting steps of both servers' connection protocols, which provide `_strikes`
    (a ConnectionStrikes) and `_calm_down(kind, detail)` (end the connection, penalise the
    identity)."""

    _strikes: ConnectionStrikes

    def _calm_down(self, kind: str, detail: str) -> None:
        raise NotImplementedError

    def _count_early_reset(self, stream_id: int, detail: str) -> None:
        over = self._strikes.early_reset(asyncio.get_running_loop().time(), stream_id, detail)
        if over is not None:
            self._calm_down(*over)

    def _count_refused(self, stream_id: int, status: int) -> None:
        """A request answered 400/413/415/431 (any other status counts nothing, and reads no
        clock). Called from the stream's own task too, which ending the connection cancels:
        so that runs as a callback."""
        if status not in REFUSED_STATUSES:
            return
        over = self._strikes.refused(asyncio.get_running_loop().time(), stream_id, status)
        if over is not None:
            asyncio.get_running_loop().call_soon(self._calm_down, *over)
