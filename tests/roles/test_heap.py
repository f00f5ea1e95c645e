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
