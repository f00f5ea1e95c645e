"""Owned records in etcd v3 (`etcd://HOST:PORT[?prefix=/sdcp/table/]`), through its JSON
gateway like the commit log (etcd_log.py). Leases are etcd leases.

Keys under the prefix:

    l/<lease id>   the holder's name, attached to the lease: it vanishes when the lease ends
    o/<key>        the record's owner stamp (records.stamp: token, lease, holder)
    v/<key>        the record's value

Every change is one transaction whose compares carry the rule:

    create   o/<key> VERSION == 0            and l/<mine> LEASE == mine
    write    o/<key> VALUE == my stamp       and l/<mine> LEASE == mine   -> put v/<key>
    delete   o/<key> VALUE == my stamp       and l/<mine> LEASE == mine   -> delete both
    take     o/<key> VALUE == stamp read     and l/<old> VERSION == 0
                                             and l/<mine> LEASE == mine   -> put o/<key> = token + 1

A missing key compares as lease 0, so `l/<mine> LEASE == mine` holds exactly while the
lease lives: the lease check and the write are one linearizable step. etcd grants at least
its minimum TTL (2 s with the default election timeout); `Lease.ttl_s` is what it granted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection

from . import etcd_http
from .api import DEFAULT_TIMEOUT_S
from .errors import CacheError
from .etcd_http import b64, unb64
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

DEFAULT_PREFIX = "/sdcp/table/"
_PAGE = 512


class EtcdRecordTable:
    def __init__(self, endpoint: str, *, prefix: str = DEFAULT_PREFIX, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.endpoint, self.prefix = endpoint, prefix.encode()
        self._http = etcd_http.client(endpoint, timeout_s)   # one member, or a cluster's

    def _k(self, kind: bytes, name: str) -> bytes:
        return self.prefix + kind + b"/" + name.encode()

    async def _post(self, path: str, body: dict, *, missing_ok: bool = False) -> dict | None:
        return await etcd_http.post(self._http, path, body, missing_ok=missing_ok)

    async def _txn(self, compares: list[dict], success: list[dict], failure: list[dict]) -> dict:
        return await self._post("/v3/kv/txn", {"compare": compares, "success": success, "failure": failure})

    def _mine(self, lease: Lease) -> dict:
        return {"key": b64(self._k(b"l", lease.id)), "target": "LEASE", "result": "EQUAL", "lease": lease.id}

    def _range(self, key: bytes) -> dict:
        return {"request_range": {"key": b64(key)}}

    def _put(self, key: bytes, value: bytes, lease: str | None = None) -> dict:
        body = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            body["lease"] = lease
        return {"request_put": body}

    # ------------------------------------------------------------------ leases

    async def grant(self, holder: str, ttl_s: float) -> Lease:
        sent = time.monotonic()
        reply = await self._post("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl_s)))})
        lease = Lease(reply["ID"], holder, float(reply["TTL"]), sent + float(reply["TTL"]))
        try:
            await self._post("/v3/kv/put", {"key": b64(self._k(b"l", lease.id)), "value": b64(holder.encode()),
                                            "lease": lease.id})
        except CacheError:
            await self.revoke(lease)
            raise
        return lease

    async def keepalive(self, lease: Lease) -> Lease | None:
        sent = time.monotonic()
        reply = await self._post("/v3/lease/keepalive", {"ID": lease.id}, missing_ok=True)
        result = (reply or {}).get("result", reply or {})
        return lease.renewed(sent) if int(result.get("TTL", 0)) > 0 else None

    async def revoke(self, lease: Lease) -> None:
        await self._post("/v3/lease/revoke", {"ID": lease.id}, missing_ok=True)

    # ------------------------------------------------------------------ records

    async def create(self, lease: Lease, key: str, value: bytes) -> Owned:
        check_key(key)
        owner = self._k(b"o", key)
        reply = await self._txn(
            [{"key": b64(owner), "target": "VERSION", "result": "EQUAL", "version": "0"}, self._mine(lease)],
            [self._put(owner, stamp(1, lease.id, lease.holder)), self._put(self._k(b"v", key), bytes(value))],
            [self._range(owner)])
        if not reply.get("succeeded"):
            if _kvs(reply["responses"][0]):
                raise Exists(key)
            raise LeaseExpired(f"lease {lease.id} has ended")
        return Owned(key, lease, 1)

    async def write(self, owned: Owned, value: bytes) -> None:
        await self._change(owned, [self._put(self._k(b"v", owned.key), bytes(value))])

    async def delete(self, owned: Owned) -> None:
        await self._change(owned, [{"request_delete_range": {"key": b64(self._k(b"o", owned.key))}},
                                   {"request_delete_range": {"key": b64(self._k(b"v", owned.key))}}])

    async def _change(self, owned: Owned, success: list[dict]) -> None:
        mine = stamp(owned.token, owned.lease.id, owned.lease.holder)
        reply = await self._txn(
            [{"key": b64(self._k(b"o", owned.key)), "target": "VALUE", "result": "EQUAL", "value": b64(mine)},
             self._mine(owned.lease)],
            success, [self._range(self._k(b"l", owned.lease.id))])
        if not reply.get("succeeded"):
            if not _kvs(reply["responses"][0]):
                raise LeaseExpired(f"lease {owned.lease.id} has ended")
            raise NotOwner(f"record {owned.key} is no longer held by lease {owned.lease.id}")

    async def take(self, lease: Lease, record: Record) -> Owned:
        owner = self._k(b"o", record.key)
        reply = await self._txn(
            [{"key": b64(owner), "target": "VALUE", "result": "EQUAL",
              "value": b64(stamp(record.token, record.lease, record.holder))},
             {"key": b64(self._k(b"l", record.lease)), "target": "VERSION", "result": "EQUAL", "version": "0"},
             self._mine(lease)],
            [self._put(owner, stamp(record.token + 1, lease.id, lease.holder))],
            [self._range(self._k(b"l", lease.id))])
        if not reply.get("succeeded"):
            if not _kvs(reply["responses"][0]):
                raise LeaseExpired(f"lease {lease.id} has ended")
            raise NotOwner(f"record {record.key} moved on, or its owner's lease is alive")
        return Owned(record.key, lease, record.token + 1)

    async def read(self, key: str) -> Record | None:
        check_key(key)
        reply = await self._txn([], [self._range(self._k(b"o", key)), self._range(self._k(b"v", key))], [])
        owner, value = (_kvs(r) for r in reply["responses"])
        if not owner or not value:
            return None
        token, lease, holder = parse_stamp(unb64(owner[0]["value"]))
        alive = await self._post("/v3/kv/range", {"key": b64(self._k(b"l", lease)), "count_only": True})
        return Record(key, unb64(value[0].get("value")), token, lease, holder,
                      int(alive.get("count", 0)) == 0)

    async def scan(self, *, values: bool = True, skip: Collection[str] = ()) -> list[Record]:
        # one range read each way, so `skip` saves decoding, not the store's work
        skip = frozenset(skip)
        owners, revision = await self._prefix(b"o/")
        leases, _ = await self._prefix(b"l/", revision, keys_only=True)
        found, _ = await self._prefix(b"v/", revision, keys_only=not values)
        out = []
        for key, raw in sorted(owners.items()):
            if key not in found or key in skip:
                continue
            token, lease, holder = parse_stamp(raw)
            out.append(Record(key, found[key], token, lease, holder, lease not in leases))
        return out

    async def _prefix(self, kind: bytes, revision: str | None = None, *,
                      keys_only: bool = False) -> tuple[dict[str, bytes], str]:
        """{name: value} of every key under prefix + kind, read at one revision (values b""
        with `keys_only`)."""
        base = self.prefix + kind
        kvs, revision = await etcd_http.read_range(self._http, base, etcd_http.prefix_end(base), page=_PAGE,
                                                   revision=revision, keys_only=keys_only)
        return {key[len(base):].decode(): value for key, value in kvs}, revision

    async def close(self) -> None:
        await self._http.aclose()


def _kvs(response: dict) -> list[dict]:
    return response.get("response_range", {}).get("kvs", [])
