"""Admission at the router: past the load the deployment serves at its latency target, new
generations wait in a bounded first-in-first-out queue instead of slowing every running
session; once the queue is full a new one is refused (the front door's 503 + Retry-After).

    admission = Admission(max_running=256, max_waiting=1024, itl_target_s=0.05)
    slot = await admission.acquire()     # waits its turn; Full when the queue is full
    ...                                  # the generation runs
    slot.release()                       # at its end, whichever path ends it (idempotent)
    slot = admission.adopt()             # a session taken over from another router: it
                                         # counts as running at once and is never refused
    admission.observe_itl(gap_s, tokens) # committed tokens of a running session
    await admission.run()                # adjusts the capacity every `interval_s`

Capacity is the number of generations that may run at once. Without a latency target it is
`max_running`. With one (`itl_target_s`, the operator's inter-token latency objective) an
AIMD controller sets it from the inter-token latency measured over each interval: a median
above the target cuts it to 80 % of the generations running (at least 1), so the overload
drains as sessions end rather than by failing any; a median below 80 % of the target, while
generations wait, raises it by one (at most `max_running`); in between, or with no tokens
measured, it is kept. It starts at `max_running`: an idle deployment admits a burst at once,
and the first interval over target cuts it back.

The median is decided exactly without keeping the observations: it is above the target when
more than half of the interval's tokens came after a gap above it (and below 80 % of it
likewise), so the controller holds three sums whatever the token rate.

A waiting generation whose client goes away (its task cancelled) leaves the queue without
taking a slot; one granted a slot at the moment it was cancelled gives the slot back. The
queue never times a request out: only a full queue refuses, so a load above capacity
queues and is served in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

UP_BELOW = 0.8        # raise capacity while the median stays under this fraction of the target
DOWN_TO = 0.8         # over target: capacity becomes this fraction of the generations running


class Full(Exception):
    """The admission queue holds `max_waiting` generations already."""


class Slot:
    """The right of one generation to run; `release()` gives it back (once: further calls
    do nothing), which admits the next waiting generation."""

    __slots__ = ("_admission", "released")

    def __init__(self, admission: Admission):
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission._released()


class Admission:
    def __init__(self, *, max_running: int = 256, max_waiting: int = 1024, itl_target_s: float = 0.0,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[float], None] = lambda seconds: None,
                 on_reject: Callable[[], None] = lambda: None):
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, not {max_running}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must not be negative, not {max_waiting}")
        if itl_target_s < 0 or interval_s <= 0:
            raise ValueError("itl_target_s must not be negative and interval_s must be positive")
        self.max_running, self.max_waiting = max_running, max_waiting
        self.itl_target_s, self.interval_s = itl_target_s, interval_s
        self.clock = clock
        self.on_wait, self.on_reject = on_wait, on_reject   # admitted after s seconds; one refused
        self.capacity = max_running
        self.running = 0                  # slots held (adopted sessions included)
        self._queue: deque[tuple[asyncio.Future, float]] = deque()   # (grant, when queued)
        self._tokens = self._over = self._under = 0     # this interval's tokens, by their gap

    @property
    def waiting(self) -> int:
        """Generations in the queue (a cancelled one leaves it when its task next runs)."""
        return sum(1 for grant, _ in self._queue if not grant.done())

    async def acquire(self) -> Slot:
        """A slot, at once if capacity allows and nobody waits, else in arrival order.
        Raises Full (nothing queued) when `max_waiting` generations wait already."""
        if not self._queue and self.running < self.capacity:
            return self._grant(self.clock())
        if self.waiting >= self.max_waiting:
            self.on_reject()
            raise Full(f"{self.waiting} generations wait for one of {self.capacity} slots")
        entry = (asyncio.get_running_loop().create_future(), self.clock())
        self._queue.append(entry)
        try:
            return await entry[0]
        except asyncio.CancelledError:
            grant = entry[0]
            if grant.done() and not grant.cancelled():
                grant.result().release()      # granted as the client went away: pass it on
            else:
                try:
                    self._queue.remove(entry)
                except ValueError:
                    pass
            raise

    def adopt(self) -> Slot:
        """A slot for a session that runs already (taken over from another router): it is
        counted at once, whatever the capacity, so that new generations wait for it."""
        self.running += 1
        return Slot(self)

    def observe_itl(self, gap_s: float, tokens: int = 1) -> None:
        """`tokens` committed tokens of a running generation came `gap_s` after its previous
        ones (each counts a gap of gap_s / tokens, as the ITL histogram does)."""
        if tokens <= 0 or not self.itl_target_s:
            return
        per_token = gap_s / tokens
        self._tokens += tokens
        if per_token > self.itl_target_s:
            self._over += tokens
        elif per_token < UP_BELOW * self.itl_target_s:
            self._under += tokens

    def adjust(self) -> None:
        """One interval's step of the controller (see the module's docstring), then admit
        whoever the new capacity lets in."""
        tokens, over, under = self._tokens, self._over, self._under
        self._tokens = self._over = self._under = 0
        if not self.itl_target_s or not tokens:
            return
        if 2 * over > tokens:
            self.capacity = max(1, int(DOWN_TO * self.running))
        elif 2 * under > tokens and self.waiting and self.capacity < self.max_running:
            self.capacity += 1
        self._dispatch()

    async def run(self) -> None:
        """Adjust every `interval_s`, until cancelled (nothing to do without a target)."""
        while self.itl_target_s:
            await asyncio.sleep(self.interval_s)
            self.adjust()

    # ------------------------------------------------------------------ internals

    def _grant(self, queued_at: float) -> Slot:
        self.running += 1
        self.on_wait(max(0.0, self.clock() - queued_at))
        return Slot(self)

    def _released(self) -> None:
        self.running -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Admit waiting generations, oldest first, while capacity allows."""
        while self._queue and self.running < self.capacity:
            grant, queued_at = self._queue.popleft()
            if grant.done():             # cancelled while waiting
                continue
            grant.set_result(self._grant(queued_at))
