"""heap.py: freed memory the C allocator held goes back to the OS (glibc), and serve's
trimming task follows `heap_trim_s`."""

from __future__ import annotations

import asyncio
import gc

import pytest

from sdcp_fast.config import ConfigError, InstanceConfig
from sdcp_fast.heap import trim_heap_every, trimmer
from sdcp_fast.memprobe import rss_mb

pytestmark = pytest.mark.skipif(trimmer() is None, reason="needs glibc's malloc_trim")


def test_trim_gives_back_memory_freed_in_the_middle_of_the_heap():
    # 1 KiB objects come from malloc (above pymalloc's 512 bytes); keeping every 64th pins the
    # heap's top, so glibc keeps the freed ~140 MB between them until it is trimmed
    objects = [bytes(1024) + bytes([i % 256]) for i in range(140_000)]
    kept = objects[::64]
    del objects
    gc.collect()
    held = rss_mb()
    assert trimmer()() is True
    assert rss_mb() < held - 60, "malloc_trim(0) returned under 60 of ~140 freed MB"
    assert len(kept) == 2188


def test_no_trimming_task_when_switched_off():
    async def main():
        await asyncio.wait_for(trim_heap_every(0), 1.0)   # returns at once
    asyncio.run(main())


def test_the_period_is_checked():
    with pytest.raises(ConfigError, match="heap_trim_s"):
        InstanceConfig(uri="https://127.0.0.1:1/", certs="c", model="m", store="s", heap_trim_s=-1)
