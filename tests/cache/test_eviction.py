"""A leased object survives eviction pressure; unleased ones go least-recently-used first."""

from __future__ import annotations

from asyncio import run

import pytest

from sdcp_fast.cache import NotFound, StoreFull, open_store

KIB = 1024


def test_embedded_lru_never_evicts_a_leased_object(shm_dir):
    async def body():
        # Cap 1000 KiB: the 400 KiB leased object plus two 300 KiB objects fit, a third not.
        store = await open_store(f"embedded:{shm_dir}?cap_bytes={1000 * KIB}")
        try:
            leased = b"L" * (400 * KIB)
            await store.put("mlc:/leased", leased, lease_ms=60_000)
            for i in range(10):
                await store.put(f"mlc:/c/{i}", bytes([i]) * (300 * KIB))
                if i == 4:
                    await store.get("mlc:/c/3")  # touch: 3 becomes most recently used
            assert await store.get("mlc:/leased") == leased
            survivors = []
            for i in range(10):
                try:
                    assert await store.get(f"mlc:/c/{i}") == bytes([i]) * (300 * KIB)
                    survivors.append(i)
                except NotFound:
                    pass
            assert survivors == [8, 9]
            # Only leased bytes left to evict: a put that cannot fit is refused, lease intact.
            await store.put("mlc:/leased2", b"M" * (500 * KIB), lease_ms=60_000)
            with pytest.raises(StoreFull):
                await store.put("mlc:/c/big", b"x" * (200 * KIB))
            assert await store.get("mlc:/leased") == leased
            # Once the lease is released the same put fits.
            await store.release("mlc:/leased")
            await store.put("mlc:/c/big", b"x" * (200 * KIB))
            with pytest.raises(NotFound):
                await store.get("mlc:/leased")
        finally:
            await store.close()

    run(body())


def test_embedded_expired_lease_frees_its_room(shm_dir):
    async def body():
        import asyncio

        store = await open_store(f"embedded:{shm_dir}?cap_bytes={1000 * KIB}")
        try:
            await store.put("mlc:/leased", b"L" * (900 * KIB), lease_ms=100)
            with pytest.raises(StoreFull):
                await store.put("mlc:/next", b"n" * (300 * KIB))
            await asyncio.sleep(0.2)
            await store.put("mlc:/next", b"n" * (300 * KIB))  # expiry purged the leased one
            with pytest.raises(NotFound):
                await store.get("mlc:/leased")
        finally:
            await store.close()

    run(body())


def test_redis_leased_object_survives_memory_pressure(clean_redis, redis_url):
    used = clean_redis.info("memory")["used_memory"]
    clean_redis.config_set("maxmemory", used + 4 * 1024 * KIB)

    async def body():
        store = await open_store(redis_url)
        try:
            leased = b"L" * (1024 * KIB)
            await store.put("mlc:/leased", leased, lease_ms=60_000)
            with pytest.raises(StoreFull):
                for i in range(64):
                    await store.put(f"mlc:/fill/{i}", b"f" * (256 * KIB))
            assert await store.get("mlc:/leased") == leased
        finally:
            await store.close()

    run(body())


def test_redis_refuses_a_policy_that_could_evict_leases(clean_redis, redis_url):
    from sdcp_fast.cache import BadSpec

    clean_redis.config_set("maxmemory-policy", "volatile-lru")
    with pytest.raises(BadSpec, match="noeviction"):
        run(open_store(redis_url))
