"""Owned records in Redis (`redis://HOST:PORT/DB[?prefix=P]`): leases are keys with a TTL.

Keys (one hash tag, so a Redis Cluster keeps them in one slot and the scripts may touch
them together):

    {P}:l:<lease>   the lease: holder name, PX ttl; keepalive is PEXPIRE while it exists
    {P}:o:<key>     the record's owner stamp (records.stamp: token, lease, holder)
    {P}:v:<key>     the record's value
    {P}:keys        the set of record keys (scans)

Every change is one Lua script, so its checks and its writes are atomic on the server:
create (my lease exists, the key does not), write and delete (the stamp is mine, my lease
exists), take (the stamp is the one read, the old lease is gone, mine exists).

Redis replication is asynchronous: a failover of Redis itself can lose a take or a write
that was acknowledged. Where router failover must be exact, use etcd.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection

from .api import DEFAULT_TIMEOUT_S
from .records import (
    Exists,
    Lease,
    LeaseExpired,
    NotOwner,
    Owned,
    Record,
    check_key,
    parse_stamp,
    stamp,
)
from .redis_store import bounded, connect

DEFAULT_PREFIX = "sdcp:table"
_CHUNK = 256

# KEYS: my lease, owner, value, key set. ARGV: stamp, value, key.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -2 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
return 0
"""

# KEYS: my lease, owner, value, key set. ARGV: stamp, value, key, "write" | "delete".
_CHANGE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -3 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[4] == 'delete' then
  redis.call('DEL', KEYS[2], KEYS[3])
  redis.call('SREM', KEYS[4], ARGV[3])
else
  redis.call('SET', KEYS[3], ARGV[2])
end
return 0
"""

# KEYS: my lease, owner, old lease. ARGV: stamp read, new stamp.
_TAKE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -3 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -4 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('SET', KEYS[2], ARGV[2])
return 0
"""

# KEYS: lease. ARGV: ttl ms.
_KEEPALIVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


class RedisRecordTable:
    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url, self.timeout_s = url, timeout_s
        self.tag = "{" + prefix + "}"
        self._redis = connect(url, timeout_s)
        self._create = self._redis.register_script(_CREATE)
        self._change = self._redis.register_script(_CHANGE)
        self._take = self._redis.register_script(_TAKE)
        self._keepalive = self._redis.register_script(_KEEPALIVE)

    def _lease_key(self, lease_id: str) -> bytes:
        return f"{self.tag}:l:{lease_id}".encode()

    def _keys(self, key: str) -> tuple[bytes, bytes]:
        return f"{self.tag}:o:{key}".encode(), f"{self.tag}:v:{key}".encode()

    @property
    def _set(self) -> bytes:
        return f"{self.tag}:keys".encode()

    async def _call(self, awaitable):
        return await bounded(awaitable, self.timeout_s)

    # ------------------------------------------------------------------ leases

    async def grant(self, holder: str, ttl_s: float) -> Lease:
        lease_id = secrets.token_hex(8)
        ttl_ms = max(1, round(ttl_s * 1000))
        sent = time.monotonic()
        await self._call(self._redis.set(self._lease_key(lease_id), holder.encode(), px=ttl_ms, nx=True))
        return Lease(lease_id, holder, ttl_ms / 1000, sent + ttl_ms / 1000)

    async def keepalive(self, lease: Lease) -> Lease | None:
        sent = time.monotonic()
        alive = await self._call(self._keepalive(keys=[self._lease_key(lease.id)],
                                                 args=[max(1, round(lease.ttl_s * 1000))]))
        return lease.renewed(sent) if alive else None

    async def revoke(self, lease: Lease) -> None:
        await self._call(self._redis.delete(self._lease_key(lease.id)))

    # ------------------------------------------------------------------ records

    async def create(self, lease: Lease, key: str, value: bytes) -> Owned:
        check_key(key)
        owner, val = self._keys(key)
        status = await self._call(self._create(
            keys=[self._lease_key(lease.id), owner, val, self._set],
            args=[stamp(1, lease.id, lease.holder), bytes(value), key.encode()]))
        _outcome(status, key, lease)
        return Owned(key, lease, 1)

    async def write(self, owned: Owned, value: bytes) -> None:
        await self._write(owned, bytes(value), "write")

    async def delete(self, owned: Owned) -> None:
        await self._write(owned, b"", "delete")

    async def _write(self, owned: Owned, value: bytes, what: str) -> None:
        owner, val = self._keys(owned.key)
        status = await self._call(self._change(
            keys=[self._lease_key(owned.lease.id), owner, val, self._set],
            args=[stamp(owned.token, owned.lease.id, owned.lease.holder), value, owned.key.encode(), what]))
        _outcome(status, owned.key, owned.lease)

    async def take(self, lease: Lease, record: Record) -> Owned:
        owner, _ = self._keys(record.key)
        status = await self._call(self._take(
            keys=[self._lease_key(lease.id), owner, self._lease_key(record.lease)],
            args=[stamp(record.token, record.lease, record.holder),
                  stamp(record.token + 1, lease.id, lease.holder)]))
        _outcome(status, record.key, lease)
        return Owned(record.key, lease, record.token + 1)

    async def read(self, key: str) -> Record | None:
        check_key(key)
        records = await self._records([key])
        return records[0] if records else None

    async def scan(self, *, values: bool = True, skip: Collection[str] = ()) -> list[Record]:
        skip = frozenset(skip)
        keys = sorted(k for k in (k.decode() for k in await self._call(self._redis.smembers(self._set)))
                      if k not in skip)
        out = []
        for n in range(0, len(keys), _CHUNK):
            out += await self._records(keys[n:n + _CHUNK], values=values)
        return out

    async def _records(self, keys: list[str], *, values: bool = True) -> list[Record]:
        names = [self._keys(key)[0] for key in keys] + ([self._keys(key)[1] for key in keys] if values else [])
        read = await self._call(self._redis.mget(names))
        found = []
        for n, key in enumerate(keys):
            owner, value = read[n], (read[len(keys) + n] if values else b"")
            if owner is not None and value is not None:
                found.append((key, parse_stamp(owner), value))
        leases = sorted({lease for _, (_, lease, _), _ in found})
        alive = {}
        if leases:
            async with self._redis.pipeline(transaction=False) as pipe:
                for lease in leases:
                    pipe.exists(self._lease_key(lease))
                alive = dict(zip(leases, await self._call(pipe.execute()), strict=True))
        return [Record(key, value, token, lease, holder, not alive[lease])
                for key, (token, lease, holder), value in found]

    async def close(self) -> None:
        await self._redis.aclose()


def _outcome(status: int, key: str, lease: Lease) -> None:
    if status == -1:
        raise LeaseExpired(f"lease {lease.id} has ended")
    if status == -2:
        raise Exists(key)
    if status == -3:
        raise NotOwner(f"record {key} is not held as expected")
    if status == -4:
        raise NotOwner(f"record {key}: its owner's lease is alive")
