"""The serving processes cap glibc's malloc arenas (sdcp_fast/heap.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from sdcp_fast import heap

PROBE = textwrap.dedent("""
    import threading
    from sdcp_fast import heap
    from sdcp_fast.memprobe import arenas_info
    print(heap.cap_arenas())
    def work():                      # each thread allocates while the others hold a lock
        keep = [bytearray(4096) for _ in range(2000)]
        barrier.wait()
    barrier = threading.Barrier(6)
    threads = [threading.Thread(target=work) for _ in range(5)]
    for t in threads: t.start()
    barrier.wait()
    for t in threads: t.join()
    print(arenas_info())
""")


def arenas_of(env: dict) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                         check=True, timeout=60).stdout.splitlines()
    return out[0], int(re.match(r"(\d+) arenas", out[1]).group(1))


def test_cap_arenas_keeps_worker_threads_in_two_arenas():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", heap.ENV)}
    assert arenas_of(env) == ("2", 2)
    cap, arenas = arenas_of({**env, heap.ENV: "0"})     # 0: glibc's default, an arena a thread
    assert cap == "None" and arenas > 2
    assert arenas_of({**env, heap.ENV: "1"})[1] == 1


def test_an_explicit_malloc_arena_max_is_left_to_glibc(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert heap.cap_arenas() is None
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv(heap.ENV, "many")
    assert heap.cap_arenas() is None


TRIM_PROBE = textwrap.dedent("""
    from sdcp_fast import heap
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    chunks = [b"x" * (64 << 10) for _ in range(800)]   # 50 MB of heap chunks (under mmap's threshold)
    del chunks[:-1]                                  # all free but the top one, which holds the heap up
    before = rss_mb()
    print(heap.trim(), before - rss_mb())
""")


def test_trim_gives_back_the_free_pages_under_a_chunk_in_use():
    """Freed chunks below one still in use stay resident until `trim` (glibc returns only a
    heap's top on free); `trim` gives their pages back."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    released, freed_mb = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True,
                                        env=env, check=True, timeout=60).stdout.split()
    assert released == "True" and float(freed_mb) > 40


def test_trim_period_from_the_environment(monkeypatch):
    monkeypatch.delenv(heap.TRIM_ENV, raising=False)
    assert heap.trim_period() == heap.TRIM_EVERY_S
    monkeypatch.setenv(heap.TRIM_ENV, "0")
    assert heap.trim_period() == 0.0
    monkeypatch.setenv(heap.TRIM_ENV, "soon")
    assert heap.trim_period() == heap.TRIM_EVERY_S


def test_keep_trimmed_with_no_period_returns_at_once():
    import asyncio
    assert asyncio.run(asyncio.wait_for(heap.keep_trimmed(0.0), timeout=5)) is None
