"""The ObjectStore contract, run against every object backend (embedded, redis)."""

from __future__ import annotations

import asyncio
from asyncio import run

import pytest

from sdcp_fast.cache import NotFound, ObjectStore, object_uri, open_store


def test_put_get_roundtrip_exact_bytes(store_spec):
    async def body():
        store = await open_store(store_spec)
        try:
            assert isinstance(store, ObjectStore)
            payload = bytes(range(256)) * 1000
            await store.put("mlc:/a", payload)
            await store.put("mlc:/b", memoryview(bytearray(b"xyz")))
            await store.put("mlc:/empty", b"")
            assert await store.get("mlc:/a") == payload
            assert await store.get("mlc:/b") == b"xyz"
            assert await store.get("mlc:/empty") == b""
            await store.put("mlc:/b", b"replaced", lease_ms=60_000)
            assert await store.get("mlc:/b") == b"replaced"
        finally:
            await store.close()

    run(body())


def test_get_missing_and_delete(store_spec):
    async def body():
        store = await open_store(store_spec)
        try:
            with pytest.raises(NotFound) as err:
                await store.get("mlc:/nothing")
            assert err.value.uri == "mlc:/nothing"
            await store.put("mlc:/d", b"1", lease_ms=60_000)
            await store.delete("mlc:/d")
            with pytest.raises(NotFound):
                await store.get("mlc:/d")
            await store.delete("mlc:/d")  # idempotent
        finally:
            await store.close()

    run(body())


def test_get_many_keeps_order_and_reports_missing(store_spec):
    async def body():
        store = await open_store(store_spec)
        try:
            uris = [f"mlc:/many/{i}" for i in range(20)]
            for i, uri in enumerate(uris):
                await store.put(uri, bytes([i]) * (i + 1))
            got = await store.get_many(list(reversed(uris)))
            assert got == [bytes([i]) * (i + 1) for i in reversed(range(20))]
            assert await store.get_many([]) == []
            with pytest.raises(NotFound) as err:
                await store.get_many([uris[0], "mlc:/many/missing", uris[1]])
            assert err.value.uri == "mlc:/many/missing"
        finally:
            await store.close()

    run(body())


def test_lease_expiry_renew_and_release(store_spec):
    async def body():
        store = await open_store(store_spec)
        try:
            await store.put("mlc:/short", b"s", lease_ms=150)
            await store.put("mlc:/renewed", b"r", lease_ms=150)
            await store.put("mlc:/released", b"x", lease_ms=60_000)
            await store.renew("mlc:/renewed", 60_000)
            await store.release("mlc:/released")
            await asyncio.sleep(0.4)
            with pytest.raises(NotFound):
                await store.get("mlc:/short")  # expired: gone
            assert await store.get("mlc:/renewed") == b"r"
            with pytest.raises(NotFound):
                await store.get("mlc:/released")  # released: gone
            with pytest.raises(NotFound):
                await store.renew("mlc:/short", 1000)  # cannot revive an expired object
            with pytest.raises(ValueError):
                await store.put("mlc:/bad", b"", lease_ms=0)
        finally:
            await store.close()

    run(body())


def test_object_uri_places_names_under_scope():
    scope = bytes(range(16))
    assert object_uri("q/abc", scope) == "mlc:/scope/000102030405060708090a0b0c0d0e0f/q/abc"
    assert object_uri("/q/abc") == "mlc:/q/abc"
    for bad_name in ["", "a/../b", "a//b", "sp ace"]:
        with pytest.raises(ValueError):
            object_uri(bad_name)
    with pytest.raises(ValueError):
        object_uri("q", b"short")
