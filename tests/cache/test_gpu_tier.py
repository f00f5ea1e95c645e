"""The embedded store's GPU tier: CUDA IPC handles shared through the common index."""

from __future__ import annotations

import subprocess
import sys
from asyncio import run

import pytest
import torch

from sdcp_fast.cache import NotFound, StoreFull, open_store

pytestmark = pytest.mark.gpu

READER = """
import asyncio, sys, torch
from sdcp_fast.cache import open_store
async def main():
    store = await open_store(sys.argv[1])
    t = await store.get_tensor("mlc:/gpu/x")
    print(t.device.type, float(t.double().sum()), t.shape[0])
asyncio.run(main())
"""


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_gpu_object_is_mapped_by_another_process(shm_dir):
    async def body():
        store = await open_store(f"embedded:{shm_dir}")
        try:
            tensor = torch.arange(1000, dtype=torch.float32, device="cuda")
            await store.put_tensor("mlc:/gpu/x", tensor, lease_ms=60_000)
            assert await store.get_tensor("mlc:/gpu/x") is tensor  # the owner's own tensor
            assert await store.get("mlc:/gpu/x") == tensor.cpu().numpy().tobytes()
            reader = subprocess.run([sys.executable, "-c", READER, f"embedded:{shm_dir}"],
                                    capture_output=True, text=True, timeout=120)
            assert reader.returncode == 0, reader.stderr
            assert reader.stdout.split() == ["cuda", str(float(sum(range(1000)))), "1000"]
        finally:
            await store.close()

    run(body())


def test_gpu_tier_shares_lru_and_leases(shm_dir):
    async def body():
        store = await open_store(f"embedded:{shm_dir}?gpu_cap_bytes={3 * 4096}")
        try:
            one_page = torch.zeros(1024, dtype=torch.float32, device="cuda")
            await store.put_tensor("mlc:/gpu/leased", one_page, lease_ms=60_000)
            for i in range(4):
                await store.put_tensor(f"mlc:/gpu/{i}", one_page.clone())
            with pytest.raises(NotFound):
                await store.get_tensor("mlc:/gpu/0")
            assert (await store.get_tensor("mlc:/gpu/leased")) is one_page
            await store.put_tensor("mlc:/gpu/leased2", one_page.clone(), lease_ms=60_000)
            await store.put_tensor("mlc:/gpu/leased3", one_page.clone(), lease_ms=60_000)
            with pytest.raises(StoreFull):
                await store.put_tensor("mlc:/gpu/more", one_page.clone())
            await store.put("mlc:/host", b"host bytes")
            assert await store.get_tensor("mlc:/host") is None  # host tier: not a GPU object
        finally:
            await store.close()

    run(body())
