"""One aioquic QuicConnection moved by the event loop through its public sans-IO API:
datagrams in (`receive_datagram`), datagrams out (`datagrams_to_send`), one timer
(`get_timer` / `handle_timer`), events out (`next_event`). Shared by the HTTP/3 client and
server.

What a loop turn leads to leaves together: datagrams read in one turn and the answers or
requests written in it are sent by one `transmit()` at the end of the turn (`transmit_soon`),
so the packets of one batch share datagrams and ACKs; a lone message leaves at once. While
an answer is being worked out (`answer_pending`, the server's), what a received datagram
leads to waits for the answer's transmit, at most ANSWER_WAIT: on a lone session's
verifier a transmit of its own would find nothing due and still cost a pass over the
connection's state per round. The connection's timer is re-armed only when it must fire earlier than the armed one; one that
fires early re-arms itself for the connection's deadline instead of acting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

ANSWER_WAIT = 0.005   # seconds a received datagram's transmit may wait for an answer's


class QuicDriver:
    """Subclasses handle events in `quic_event(event)`; `send(data, addr)` writes a datagram."""

    def __init__(self, quic, send: Callable[[bytes, object], None]):
        self.quic = quic
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._soon: asyncio.Handle | None = None   # a transmit queued for later in this turn, or ANSWER_WAIT

    def quic_event(self, event) -> None:
        raise NotImplementedError

    def answer_pending(self) -> bool:
        return False

    def receive(self, data: bytes, addr) -> None:
        self.quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        if self._soon is None and self.answer_pending():
            self._soon = self._loop.call_later(ANSWER_WAIT, self.transmit)
        else:
            self.transmit_soon()

    def transmit_soon(self) -> None:
        """A transmit at the end of this loop turn (not later: an ANSWER_WAIT one is advanced)."""
        if self._soon is None or isinstance(self._soon, asyncio.TimerHandle):
            if self._soon is not None:
                self._soon.cancel()
            self._soon = self._loop.call_soon(self.transmit)

    def transmit(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        for data, addr in self.quic.datagrams_to_send(now=self._loop.time()):
            self._send(data, addr)
        at = self.quic.get_timer()
        if at is not None and (self._timer_at is None or at < self._timer_at):
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        now = self._loop.time()
        at = self.quic.get_timer()
        if at is None:
            return
        if at > now:   # the deadline moved later since it was armed
            self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at
            return
        self.quic.handle_timer(now=now)
        self._process_events()
        self.transmit()

    def _process_events(self) -> None:
        event = self.quic.next_event()
        while event is not None:
            self.quic_event(event)
            event = self.quic.next_event()

    def stop_timer(self) -> None:
        """The connection is over: no timer, no queued transmit."""
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._timer_at = self._soon = None
