"""Commit logs in etcd v3 (`etcd://HOST:PORT`), the production choice (section 6.9).

etcd transactions are linearizable, so an acknowledged append survives any failover of the
etcd cluster. There is no maintained Python etcd client; this talks to the v3 JSON gateway
that etcd 3.4 serves under `/v3/` on its client URL, with httpx (keys and values base64).

Keys of one log (a hash of its name, so any URI works):

    <prefix><h>/len        number of entries, 20-digit zero-padded decimal
    <prefix><h>/fence      highest fence epoch, 20-digit zero-padded decimal
    <prefix><h>/e/<pos>    entry at position pos (20 digits): kind || epoch || record

Zero padding makes etcd's bytewise VALUE comparisons numeric. An append is one transaction:

    compare  len == expected  (or len absent when expected is 0)
        and  fence < epoch + 1  (or fence absent)
    success  put e/<expected>, put len = expected + 1
    failure  range len, range fence   -> Conflict(len) or Fenced(fence)

A missing key fails every VALUE comparison, so the client picks the "absent" form (VERSION
== 0) from what it last saw and retries once with the other form if it guessed wrong.
What it last saw is an LRU of `max_cached_logs` logs; a forgotten log costs one retry.

Timeouts bound each HTTP call; a transaction whose reply timed out may still have been
applied by etcd, so a timed-out append may have landed: read position `expected` to know.
"""

from __future__ import annotations

import hashlib

from . import etcd_http
from .api import DEFAULT_TIMEOUT_S, LogEntry, check_epoch, check_position
from .entries import pack_entry, unpack_entry
from .errors import CacheError, Conflict, Fenced, StoreTimeout
from .etcd_http import b64, unb64
from .lru import DEFAULT_MAX_LOGS, LruCache

DEFAULT_PREFIX = "/sdcp/log/"
_RANGE_PAGE = 512
_RETRIES = 50


def _pad(number: int) -> bytes:
    return b"%020d" % number


class EtcdCommitLog:
    """`CommitLog` on etcd through its JSON gateway."""

    def __init__(self, endpoint: str, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_cached_logs: int = DEFAULT_MAX_LOGS):
        self.endpoint, self.prefix = endpoint, prefix.encode()
        self._http = etcd_http.client(endpoint, timeout_s)   # one member, or a cluster's
        # log -> (length, fence) last seen
        self._known: LruCache[str, tuple[int, int]] = LruCache(max_cached_logs)

    def _key(self, log: str, suffix: bytes) -> bytes:
        return self.prefix + hashlib.sha256(log.encode()).hexdigest()[:40].encode() + suffix

    async def _post(self, path: str, body: dict) -> dict:
        return await etcd_http.post(self._http, path, body)

    def _compare_number(self, key: bytes, known: int, op: str, bound: int) -> dict:
        """`key` absent when `known` is 0, else `value op pad(bound)`."""
        if known == 0:
            return {"key": b64(key), "target": "VERSION", "result": "EQUAL", "version": "0"}
        return {"key": b64(key), "target": "VALUE", "result": op, "value": b64(_pad(bound))}

    async def _txn(self, log: str, compares: list[dict], puts: list[tuple[bytes, bytes]]):
        """Run a transaction; returns (succeeded, length now, fence now)."""
        len_key, fence_key = self._key(log, b"/len"), self._key(log, b"/fence")
        reply = await self._post("/v3/kv/txn", {
            "compare": compares,
            "success": [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in puts],
            "failure": [{"request_range": {"key": b64(len_key)}},
                        {"request_range": {"key": b64(fence_key)}}],
        })
        if reply.get("succeeded"):
            return True, None, None
        length, fence = (_number(r["response_range"]) for r in reply["responses"])
        self._known.put(log, (length, fence))
        return False, length, fence

    async def append(self, log: str, record: bytes, *, epoch: int, expected: int) -> int:
        check_epoch(epoch)
        check_position(expected)
        len_key, fence_key = self._key(log, b"/len"), self._key(log, b"/fence")
        entry = pack_entry("commit", epoch, record)
        for _ in range(2):  # at most one retry, after learning whether the fence key exists
            _, fence_seen = self._known.get(log, (0, 0))
            compares = [self._compare_number(len_key, expected, "EQUAL", expected),
                        self._compare_number(fence_key, fence_seen, "LESS", epoch + 1)]
            puts = [(self._key(log, b"/e/" + _pad(expected)), entry),
                    (len_key, _pad(expected + 1))]
            ok, length, fence = await self._txn(log, compares, puts)
            if ok:
                self._known.put(log, (expected + 1, fence_seen))
                return expected + 1
            if fence > epoch:
                raise Fenced(fence)
            if length != expected:
                raise Conflict(length)
        raise CacheError(f"etcd append to {log} failed without a conflict")

    async def fence(self, log: str, epoch: int) -> int:
        check_epoch(epoch, minimum=1)
        len_key, fence_key = self._key(log, b"/len"), self._key(log, b"/fence")
        entry = pack_entry("fence", epoch, b"")
        length, fence = self._known.get(log, (0, 0))
        for _ in range(_RETRIES):
            if fence > epoch:
                raise Fenced(fence)
            if fence == epoch:
                return length  # a retried fence: already in place
            compares = [self._compare_number(len_key, length, "EQUAL", length),
                        self._compare_number(fence_key, fence, "EQUAL", fence)]
            puts = [(self._key(log, b"/e/" + _pad(length)), entry),
                    (len_key, _pad(length + 1)), (fence_key, _pad(epoch))]
            ok, new_length, new_fence = await self._txn(log, compares, puts)
            if ok:
                self._known.put(log, (length + 1, epoch))
                return length + 1
            length, fence = new_length, new_fence  # lost a race: retry on the new state
        raise StoreTimeout(f"fence of {log} kept losing races")

    async def read(self, log: str, start: int = 0) -> list[LogEntry]:
        check_position(start)
        entries_prefix = self._key(log, b"/e/")
        kvs, _ = await etcd_http.read_range(self._http, entries_prefix + _pad(start),
                                            etcd_http.prefix_end(entries_prefix), page=_RANGE_PAGE)
        entries = []
        for key, value in kvs:
            position = int(key[len(entries_prefix):])
            if position != start + len(entries):
                raise CacheError(f"etcd log {log}: entry {position} out of sequence")
            entries.append(unpack_entry(position, value))
        return entries

    async def close(self) -> None:
        await self._http.aclose()


def _number(range_response: dict) -> int:
    kvs = range_response.get("kvs", [])
    return int(unb64(kvs[0]["value"])) if kvs else 0
