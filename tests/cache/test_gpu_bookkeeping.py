"""The GPU tier's index bookkeeping (LRU, leases, caps, owner liveness) without CUDA.

The GPU tier differs from the host tier only in where bytes live; these tests drive its
index path (`_put_gpu`) with CPU tensors and a placeholder handle, so every CPU run covers
the shared logic. Real CUDA IPC is in test_gpu_tier.py (marked gpu).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from asyncio import run

import pytest
import torch

from sdcp_fast.cache import NotFound, StoreFull
from sdcp_fast.cache.embedded_store import EmbeddedStore

PAGE = 4096  # bytes of one 1024-element fp32 tensor


async def put_gpu(store: EmbeddedStore, uri: str, lease_ms: int | None = None):
    tensor = torch.zeros(PAGE // 4, dtype=torch.float32)
    await asyncio.to_thread(store._put_gpu, uri, tensor, b"handle", lease_ms)
    return tensor


def test_gpu_tier_lru_leases_and_cap_are_separate_from_host(shm_dir):
    async def body():
        store = EmbeddedStore(shm_dir, cap_bytes=PAGE, gpu_cap_bytes=3 * PAGE)
        try:
            leased = await put_gpu(store, "mlc:/g/leased", lease_ms=60_000)
            kept = [await put_gpu(store, f"mlc:/g/{i}") for i in range(4)]
            await store.put("mlc:/h", b"h" * PAGE)  # host tier: its own cap
            with pytest.raises(NotFound):
                await store.get_tensor("mlc:/g/0")
            with pytest.raises(NotFound):
                await store.get_tensor("mlc:/g/1")
            assert await store.get_tensor("mlc:/g/2") is kept[2]
            assert await store.get_tensor("mlc:/g/leased") is leased
            assert await store.get_tensor("mlc:/h") is None
            assert sorted(store._held) == ["mlc:/g/2", "mlc:/g/3", "mlc:/g/leased"]
            await put_gpu(store, "mlc:/g/l2", lease_ms=60_000)
            await put_gpu(store, "mlc:/g/l3", lease_ms=60_000)
            with pytest.raises(StoreFull):
                await put_gpu(store, "mlc:/g/more")
            await store.release("mlc:/g/leased")  # also frees this process's reference
            assert "mlc:/g/leased" not in store._held
            await put_gpu(store, "mlc:/g/more")
        finally:
            await store.close()

    run(body())


EXPORTER = """
import sys, torch
from sdcp_fast.cache.embedded_store import EmbeddedStore
store = EmbeddedStore(sys.argv[1])
store._put_gpu("mlc:/g/orphan", torch.zeros(4), b"handle", 60_000)
"""


def test_objects_of_a_dead_exporter_are_gone(shm_dir):
    exporter = subprocess.run([sys.executable, "-c", EXPORTER, str(shm_dir)], timeout=120)
    assert exporter.returncode == 0

    async def body():
        store = EmbeddedStore(shm_dir)
        try:
            with pytest.raises(NotFound):  # its device memory died with it, lease or not
                await store.get_tensor("mlc:/g/orphan")
            with pytest.raises(NotFound):
                await store.get("mlc:/g/orphan")  # and the index row was purged
        finally:
            await store.close()

    run(body())
