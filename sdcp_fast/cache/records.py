"""Owned records: a table of small records, each owned by the holder of a lease, with a
fencing token per record. The router keeps its session table here (router/stored.py says
what a record holds); `open_table` picks the backend:

    table = await open_table("file:DIR" | "redis://HOST:PORT/DB[?prefix=P]"
                             | "etcd://HOST:PORT[?prefix=/sdcp/table/]")
    lease = await table.grant(holder: str, ttl_s: float) -> Lease      # ttl_s as granted
    lease = await table.keepalive(lease) -> Lease | None   # None: ended (for good)
    await table.revoke(lease) -> None             # end it now: others may take its records
    owned = await table.create(lease, key, value) -> Owned            # Exists, LeaseExpired
    await table.write(owned, value) -> None       # NotOwner, LeaseExpired
    owned = await table.take(lease, record) -> Owned                  # NotOwner, LeaseExpired
    await table.delete(owned) -> None             # NotOwner, LeaseExpired
    await table.read(key) -> Record | None
    await table.scan(values=True, skip=()) -> list[Record]   # values=False: stamps only (value b"");
                                                  # keys in `skip` are left out unread
    await table.close() -> None

Rules, the same on every backend, each one atomic in the store (an etcd transaction, a
Redis Lua script, an exclusive file creation):

- A record has an owner stamp: (token, lease, holder). `create` sets token 1.
- `write` and `delete` succeed only if the record's stamp is still the caller's AND the
  caller's lease is alive, checked in the same atomic step as the write. A holder that lost
  its lease, or whose record was taken, can never write it again (`NotOwner`).
- `take` moves a record whose owner's lease has ended (`Record.orphaned`) to the caller's
  live lease with token + 1, only if the stamp is still the one the caller read: of two
  routers taking the same record, one wins. Tokens only grow: the token is the fencing
  token a new owner sends with every instruction, so peers refuse a former owner's late ones.
- A lease lives `ttl_s` past its last keepalive as the store sees it; the holder's own view
  (`Lease.deadline`: the send time of its last successful keepalive + ttl_s) ends no later,
  so a holder that trusts its view never acts after the store has let its records go.

Safety rests on the tokens (every write compares the stamp in the store); leases only
decide when a record may be taken (liveness). Timeouts bound every call (`timeout_s` in
any spec's query, default 5 s); a timed-out write may have landed: read to know.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import CacheError


class NotOwner(CacheError):
    """The record is no longer the caller's: taken by another holder, deleted, or the
    caller's lease has ended."""


class LeaseExpired(NotOwner):
    """The caller's lease has ended: none of its records can be written any more."""


class Exists(CacheError):
    """`create` of a key that is already in the table."""


@dataclass(frozen=True)
class Lease:
    id: str              # the store's lease id
    holder: str          # who holds it (a router's URI): logs and scans
    ttl_s: float         # as granted (etcd rounds up to whole seconds, at least 2)
    deadline: float = 0.0   # time.monotonic() until which the holder may trust it

    def valid(self, margin_s: float = 0.0) -> bool:
        return time.monotonic() < self.deadline - margin_s

    def renewed(self, sent_at: float) -> Lease:
        """The lease after a keepalive sent at monotonic `sent_at` was answered."""
        return Lease(self.id, self.holder, self.ttl_s, sent_at + self.ttl_s)


@dataclass(frozen=True)
class Owned:
    """A record held: `key` owned under `lease` with fencing token `token`."""

    key: str
    lease: Lease
    token: int


@dataclass(frozen=True)
class Record:
    key: str
    value: bytes
    token: int
    lease: str           # the owner's lease id
    holder: str          # the owner's holder name
    orphaned: bool       # the owner's lease has ended: `take` may move the record


@runtime_checkable
class RecordTable(Protocol):
    async def grant(self, holder: str, ttl_s: float) -> Lease: ...
    async def keepalive(self, lease: Lease) -> Lease | None: ...
    async def revoke(self, lease: Lease) -> None: ...
    async def create(self, lease: Lease, key: str, value: bytes) -> Owned: ...
    async def write(self, owned: Owned, value: bytes) -> None: ...
    async def take(self, lease: Lease, record: Record) -> Owned: ...
    async def delete(self, owned: Owned) -> None: ...
    async def read(self, key: str) -> Record | None: ...
    async def scan(self, *, values: bool = True, skip: Collection[str] = ()) -> list[Record]: ...
    async def close(self) -> None: ...


def stamp(token: int, lease: str, holder: str) -> bytes:
    """The owner stamp as the stores hold it: zero-padded token (bytewise order is numeric
    order), lease id, holder."""
    return b"%020d\x00%s\x00%s" % (token, lease.encode(), holder.encode())


def parse_stamp(data: bytes) -> tuple[int, str, str]:
    token, lease, holder = data.split(b"\x00", 2)
    return int(token), lease.decode(), holder.decode()


def check_key(key: str) -> None:
    if not key or not key.isascii() or any(c in key for c in "/\x00 ") or key in (".", ".."):
        raise ValueError(f"bad record key {key!r}: ASCII without '/', NUL or spaces")
