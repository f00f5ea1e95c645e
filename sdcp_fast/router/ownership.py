"""This router's lease on the session table, and the session records it holds (the session
table is a `cache.RecordTable`; what a record holds is stored.py).

    own = Ownership(table, holder=router_uri, ttl_s=2.0, on_lost=...)
    await own.start()                 # grant the lease; `keep()` renews it (a task)
    await own.create(s)               # a new session's record, before anything is placed
    await own.act(s)                  # before every action that writes, and after it
    owned = await own.take(record)    # an orphaned record (its owner's lease ended)
    await own.delete(s)               # a finished session, closed_keep_s later

`act` writes the session's state to its record in one atomic step with the checks that the
record is still this router's and its lease alive, then checks the lease's local deadline;
it raises `NotOwner` otherwise, and the router stops acting for the session (it may still
stream it: follow.py). Every fence, session-open, drafter assignment and policy update is
preceded by an `act`, so a router that lost a session can send at most the one message it
was about to send when it lost it; that message carries its router epoch (the record's
token), which the verifier and drafters refuse once the new owner has spoken
(docs/ARCHITECTURE.md, "Routers: ownership").

The lease is renewed every ttl / 3. It is lost when a keepalive says it ended or when its
local deadline (send time of the last answered keepalive + ttl) passes first, e.g. after the
process was stopped: then `on_lost` is called (every record of the lease is gone, the
router keeps only followers) and a new lease is granted, under which orphaned records, its
former ones too, are taken again like any other router's.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..aio import KeyedLock
from ..cache import CacheError, Lease, NotOwner, Owned, Record, RecordTable
from . import stored
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router.ownership")


class Ownership:
    def __init__(self, table: RecordTable, *, holder: str, ttl_s: float, on_lost=None):
        self.table = table
        self.holder = holder
        self.ttl_s = ttl_s
        self.margin_s = ttl_s / 10          # stop acting this much before the deadline
        self.on_lost = on_lost or (lambda: None)
        self.lease: Lease | None = None
        self.closed = False                   # handed over: no lease is awaited any more
        self.locks = KeyedLock()              # one write per record at a time
        self.leases_granted = 0

    # ------------------------------------------------------------------ the lease

    async def start(self) -> None:
        self.lease = await self.table.grant(self.holder, self.ttl_s)
        self.leases_granted += 1
        log.info("lease %s granted (ttl %.1f s)", self.lease.id, self.lease.ttl_s)

    def valid(self) -> bool:
        return self.lease is not None and self.lease.valid(self.margin_s)

    async def health_check(self) -> None:
        """For /health: a router without a lease takes no sessions."""
        if not self.valid():
            raise NotOwner("no lease on the session table now")

    async def keep(self) -> None:
        """Renew the lease until cancelled; a lost lease is reported and replaced."""
        while True:
            lease = self.lease
            if lease is None:
                await self._regrant()
                continue
            await asyncio.sleep(max(0.0, min(lease.ttl_s / 3, lease.deadline - time.monotonic() - self.margin_s)))
            if not lease.valid(self.margin_s):
                self._lost(lease, "its deadline passed before a keepalive was answered")
                continue
            try:
                renewed = await self.table.keepalive(lease)
            except CacheError as exc:
                log.warning("lease %s: keepalive failed: %s", lease.id, exc)
                await asyncio.sleep(min(0.1, lease.ttl_s / 10))
                continue
            if self.lease is not lease:
                continue
            if renewed is None:
                self._lost(lease, "the store says it has ended")
            else:
                self.lease = renewed

    def lost_lease(self, why: str) -> None:
        """A write said the lease has ended (LeaseExpired) before a keepalive did."""
        if self.lease is not None:
            self._lost(self.lease, why)

    def _lost(self, lease: Lease, why: str) -> None:
        if self.lease is not lease:
            return
        log.warning("lease %s lost: %s; this router stops acting for its sessions", lease.id, why)
        self.lease = None
        self.on_lost()

    async def _regrant(self) -> None:
        try:
            await self.start()
        except CacheError as exc:
            log.warning("lease not granted: %s", exc)
            await asyncio.sleep(min(1.0, self.ttl_s / 4))

    async def close(self) -> None:
        """Hand the sessions over now: others take them at their next scan."""
        lease, self.lease = self.lease, None
        self.closed = True
        if lease is not None:
            try:
                await self.table.revoke(lease)
            except CacheError as exc:
                log.info("lease %s not revoked (it ends at its ttl): %s", lease.id, exc)

    # ------------------------------------------------------------------ records

    def holds(self, s: RouterSession) -> bool:
        owned = s.owned
        return isinstance(owned, Owned) and self.lease is not None and owned.lease.id == self.lease.id

    def check(self, s: RouterSession) -> None:
        """Raise NotOwner unless this router may act for `s` now."""
        if not self.holds(s):
            raise NotOwner(f"session {s.id.hex()} is not held by this router's lease")
        if not self.valid():
            raise NotOwner(f"lease {self.lease.id} is past its deadline")

    async def create(self, s: RouterSession) -> None:
        """A new session's record. Without a lease now (lost, `keep` granting the next one)
        it waits up to one ttl for it: a new session is not refused for a renewal that missed
        its deadline by moments."""
        if self.table is None:
            raise NotOwner("this router has no session table")
        await self._await_lease(self.ttl_s)
        if not self.valid():
            raise NotOwner("this router holds no lease on a session table now")
        s.owned = await self.table.create(self.lease, stored.key_of(s.id), stored.encode(s))
        s.router_epoch = s.owned.token

    async def _await_lease(self, timeout_s: float) -> None:
        """Until a valid lease (`keep` renews or grants it), at most `timeout_s`; checked every
        quarter of the margin, a wait as rare as a lost lease."""
        deadline = time.monotonic() + timeout_s
        while not self.closed and not self.valid() and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, self.margin_s / 4))

    async def act(self, s: RouterSession) -> None:
        """Write the session's state; raise NotOwner if it is not this router's to act on."""
        async with self.locks.hold(s.id):
            self.check(s)
            await self.table.write(s.owned, stored.encode(s))
            self.check(s)          # the write may have taken long: the deadline again

    async def take(self, record: Record) -> Owned:
        if not self.valid():
            raise NotOwner("this router holds no lease now")
        return await self.table.take(self.lease, record)

    async def delete(self, s: RouterSession) -> None:
        async with self.locks.hold(s.id):
            self.check(s)
            await self.table.delete(s.owned)
