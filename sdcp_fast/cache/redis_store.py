"""Objects in Redis (`redis://HOST:PORT/DB`): leases are key TTLs.

- A leased object is `SET key data PX lease_ms`; renew is `PEXPIRE`, release and delete are
  `DEL`. An unleased object gets `cache_ttl_ms` (default 10 minutes) so the cache cannot
  fill up with objects nobody will ask for again.
- Never evicting a leased object needs `maxmemory-policy noeviction` (Redis's default):
  every other policy may drop keys with a TTL, that is leased objects. `open` checks the
  policy and refuses others; when memory is full a put raises `StoreFull` instead.
- Every call is bounded by `timeout_s` (client socket timeouts and an asyncio bound).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from .api import DEFAULT_TIMEOUT_S, check_lease
from .errors import BadSpec, CacheError, NotFound, StoreFull, StoreTimeout

DEFAULT_CACHE_TTL_MS = 600_000
KEY_PREFIX = "sdcp:obj:"
_MGET_CHUNK = 8  # keys per round trip in get_many; chunks go out concurrently


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, decode_responses=False)


async def bounded(awaitable, timeout_s: float):
    """Await a Redis call under `timeout_s`, mapping Redis errors to the cache's types.

    A `StoreTimeout` means the reply was late, not that the command did not run: Redis may
    have executed it (a put stored, an append landed). Callers that must know re-read.
    A connection refused, closed mid-call or to a server still loading its data (a Redis
    restarting) is a `CacheError` like any other store's trouble, so that the roles' retry
    loops (lease keepalive, session-table scans, appends) go on; a closed connection too
    may leave the command run.
    """
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except (TimeoutError, redis_errors.TimeoutError) as exc:
        raise StoreTimeout(f"redis call exceeded {timeout_s}s") from exc
    except redis_errors.OutOfMemoryError as exc:
        raise StoreFull(str(exc)) from exc
    except redis_errors.ConnectionError as exc:     # BusyLoadingError (LOADING) is one too
        raise CacheError(f"redis unreachable: {exc}") from exc


class RedisStore:
    """`ObjectStore` on one Redis server (or a Redis-protocol proxy)."""

    def __init__(self, url: str, *, cache_ttl_ms: int = DEFAULT_CACHE_TTL_MS,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url, self.cache_ttl_ms, self.timeout_s = url, cache_ttl_ms, timeout_s
        self._redis = connect(url, timeout_s)

    @classmethod
    async def open(cls, url: str, **options) -> RedisStore:
        store = cls(url, **options)
        await store.check_eviction_policy()
        return store

    async def check_eviction_policy(self) -> None:
        try:
            config = await self._call(self._redis.config_get("maxmemory-policy"))
        except redis_errors.ResponseError:
            return  # CONFIG disabled (managed Redis): the operator vouches for the policy
        # redis-py decodes CONFIG replies to str even with decode_responses=False
        policy = {_text(k): _text(v) for k, v in config.items()}.get("maxmemory-policy",
                                                                      "noeviction")
        if policy != "noeviction":
            await self.close()
            raise BadSpec(f"{self.url}: maxmemory-policy is {policy!r}; leased objects "
                          "are only safe under 'noeviction'")

    def key(self, uri: str) -> bytes:
        return (KEY_PREFIX + uri).encode()

    async def _call(self, awaitable):
        return await bounded(awaitable, self.timeout_s)

    async def put(self, uri: str, data: bytes | memoryview, lease_ms: int | None = None) -> None:
        check_lease(lease_ms)
        ttl = lease_ms if lease_ms is not None else self.cache_ttl_ms
        await self._call(self._redis.set(self.key(uri), bytes(data), px=ttl))

    async def get(self, uri: str) -> bytes:
        data = await self._call(self._redis.get(self.key(uri)))
        if data is None:
            raise NotFound(uri)
        return data

    async def get_many(self, uris: Sequence[str]) -> list[bytes]:
        chunks = [uris[i:i + _MGET_CHUNK] for i in range(0, len(uris), _MGET_CHUNK)]
        replies = await self._call(asyncio.gather(
            *(self._redis.mget([self.key(u) for u in chunk]) for chunk in chunks)))
        values = [value for reply in replies for value in reply]
        for uri, value in zip(uris, values, strict=True):
            if value is None:
                raise NotFound(uri)
        return values

    async def renew(self, uri: str, lease_ms: int) -> None:
        check_lease(lease_ms)
        if not await self._call(self._redis.pexpire(self.key(uri), lease_ms)):
            raise NotFound(uri)

    async def release(self, uri: str) -> None:
        await self._call(self._redis.delete(self.key(uri)))

    async def delete(self, uri: str) -> None:
        await self._call(self._redis.delete(self.key(uri)))

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
