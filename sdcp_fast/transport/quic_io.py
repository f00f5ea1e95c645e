"""One aioquic QuicConnection moved by the event loop through its public sans-IO API:
datagrams in (`receive_datagram`), datagrams out (`datagrams_to_send`), one timer
(`get_timer` / `handle_timer`), events out (`next_event`). Shared by the HTTP/3 client and
server.

What a loop turn leads to leaves together: datagrams read in one turn and the answers or
requests written in it are sent by one `transmit()` at the end of the turn (`transmit_soon`),
so the packets of one batch share datagrams and ACKs; a lone message leaves at once. The
connection's timer is re-armed only when it must fire earlier than the armed one; one that
fires early re-arms itself for the connection's deadline instead of acting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class QuicDriver:
    """Subclasses handle events in `quic_event(event)`; `send(data, addr)` writes a datagram."""

    def __init__(self, quic, send: Callable[[bytes, object], None]):
        self.quic = quic
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_queued = False

    def quic_event(self, event) -> None:
        raise NotImplementedError

    def receive(self, data: bytes, addr) -> None:
        self.quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        self.transmit_soon()

    def transmit_soon(self) -> None:
        if not self._transmit_queued:
            self._transmit_queued = True
            self._loop.call_soon(self.transmit)

    def transmit(self) -> None:
        self._transmit_queued = False
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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
