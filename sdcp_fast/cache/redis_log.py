"""Commit logs in Redis (`redis://HOST:PORT/DB`), two ways of fencing.

- Default: one Lua script checks the expected length and the fence epoch and appends, all
  atomically on the server (a script runs alone). Epochs travel as Lua numbers (doubles),
  hence `api.MAX_EPOCH`.
- `?fencing=check`: only a conditional append (WATCH/MULTI on the list), as a store without
  server-side scripts offers; the writer then runs the draft's read-after-append check
  (`fencing.check_after_append`). A record so refused stays in the list; readers skip it
  with `api.effective_commits`.

Timeouts: a call that times out may still have run on the server (the command was sent;
only the reply was late). A timed-out append may therefore have landed; in check mode it may
even have landed and then been refused by a fence. The caller learns the outcome by reading
position `expected` (and, in check mode, by `effective_commits`). Per-log check progress is
an LRU of `max_cached_logs` entries; a forgotten log is checked again from its start.

Durability is the server's configuration: an acknowledged append survives a Redis restart
(kill -9 included) only with `appendonly yes` and `appendfsync always` (Redis fsyncs the
append-only file before it answers); Redis's default `everysec` may lose the last second of
acknowledged appends, RDB snapshots alone (or none) more. tests/roles/test_faults.py
restarts such a Redis mid-generation. While Redis is down every call raises `CacheError`
(redis_store.bounded). Redis replication is asynchronous: a failover can lose acknowledged
appends. Use etcd for the commit log where verifier failover must be exact (section 6.9).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis import exceptions as redis_errors

from .api import DEFAULT_TIMEOUT_S, Append, LogEntry, append_each, check_epoch, check_position
from .entries import pack_entry, unpack_entry
from .errors import Conflict, Fenced, StoreTimeout
from .fencing import Checked, check_after_append
from .lru import DEFAULT_MAX_LOGS, LruCache
from .redis_store import bounded, connect

# KEYS[1]: entry list; KEYS[2]: highest fence epoch.
# ARGV: kind ('c' commit / 'f' fence), epoch, expected length (commit), packed entry.
# Returns {0, new length} | {-1, current length} (conflict) | {-2, fence epoch} (fenced).
_APPEND_LUA = """
local len = redis.call('LLEN', KEYS[1])
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
local epoch = tonumber(ARGV[2])
if fence > epoch then return {-2, fence} end
if ARGV[1] == 'c' then
  if len ~= tonumber(ARGV[3]) then return {-1, len} end
else
  if fence == epoch then return {0, len} end
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('RPUSH', KEYS[1], ARGV[4])
return {0, len + 1}
"""

_WATCH_RETRIES = 50


class RedisCommitLog:
    """`CommitLog` on Redis; `server_fencing=False` selects the read-after-append mode."""

    def __init__(self, url: str, *, server_fencing: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_cached_logs: int = DEFAULT_MAX_LOGS):
        self.url, self.server_fencing, self.timeout_s = url, server_fencing, timeout_s
        self._redis = connect(url, timeout_s)
        self._script = self._redis.register_script(_APPEND_LUA)
        # read-after-append progress per log
        self._checked: LruCache[str, Checked] = LruCache(max_cached_logs)

    def keys(self, log: str) -> tuple[bytes, bytes]:
        tag = hashlib.sha256(log.encode()).hexdigest()[:32]
        return f"sdcp:log:{{{tag}}}:entries".encode(), f"sdcp:log:{{{tag}}}:fence".encode()

    async def _call(self, awaitable):
        return await bounded(awaitable, self.timeout_s)

    async def append(self, log: str, record: bytes, *, epoch: int, expected: int) -> int:
        check_epoch(epoch)
        check_position(expected)
        entry = pack_entry("commit", epoch, record)
        if not self.server_fencing:
            length = await self._conditional_push(log, entry, expected)
            self._checked.put(log, await check_after_append(
                self, log, expected, epoch, self._checked.get(log, Checked())))
            return length
        status, value = await self._call(
            self._script(keys=self.keys(log), args=["c", epoch, expected, entry]))
        return _outcome(status, value)

    async def append_batch(self, appends: Sequence[Append]) -> list[int | Exception]:
        """See `api.append_batch`: the batch's scripts in one pipelined round trip (each
        script still runs atomically on the server); in check mode, each append alone."""
        if not self.server_fencing:
            return await append_each(self, appends)
        for a in appends:
            check_epoch(a.epoch)
            check_position(a.expected)

        async def pipelined() -> list:
            async with self._redis.pipeline(transaction=False) as pipe:
                for a in appends:
                    await self._script(keys=self.keys(a.log), args=["c", a.epoch, a.expected,
                                                                    pack_entry("commit", a.epoch, a.record)],
                                       client=pipe)   # queued: the pipeline sends them together
                return await pipe.execute(raise_on_error=False)

        answers: list[int | Exception] = []
        for reply in await self._call(pipelined()):
            if isinstance(reply, Exception):
                answers.append(reply)
                continue
            try:
                answers.append(_outcome(*reply))
            except (Fenced, Conflict) as exc:
                answers.append(exc)
        return answers

    async def fence(self, log: str, epoch: int) -> int:
        check_epoch(epoch, minimum=1)
        entry = pack_entry("fence", epoch, b"")
        if self.server_fencing:
            status, value = await self._call(
                self._script(keys=self.keys(log), args=["f", epoch, 0, entry]))
            return _outcome(status, value)
        for _ in range(_WATCH_RETRIES):
            entries = await self.read(log)
            highest = max((e.epoch for e in entries if e.kind == "fence"), default=0)
            if highest > epoch:
                raise Fenced(highest)
            if highest == epoch:
                return len(entries)
            try:
                return await self._conditional_push(log, entry, len(entries))
            except Conflict:
                continue  # someone appended meanwhile; a fence goes in regardless
        raise StoreTimeout(f"fence of {log} kept losing races")

    async def _conditional_push(self, log: str, entry: bytes, expected: int) -> int:
        key = self.keys(log)[0]

        async def attempt() -> int:
            async with self._redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                length = await pipe.llen(key)
                if length != expected:
                    raise Conflict(length)
                pipe.multi()
                pipe.rpush(key, entry)
                try:
                    (new_length,) = await pipe.execute()
                except redis_errors.WatchError:
                    raise Conflict(await self._redis.llen(key)) from None
                return new_length

        return await self._call(attempt())

    async def read(self, log: str, start: int = 0) -> list[LogEntry]:
        check_position(start)
        payloads = await self._call(self._redis.lrange(self.keys(log)[0], start, -1))
        return [unpack_entry(start + i, p) for i, p in enumerate(payloads)]

    async def close(self) -> None:
        await self._redis.aclose()


def _outcome(status: int, value: int) -> int:
    if status == -2:
        raise Fenced(value)
    if status == -1:
        raise Conflict(value)
    return value
