"""Hand memory the C allocator holds but nobody uses back to the OS, now and then (glibc).

Why: a serving process allocates and frees small objects by the million (a request's
headers, its CBOR, its futures), from several threads (the event loop, the commit log's and
the models' workers). glibc keeps what Python frees in its arenas for reuse and gives back
only what lies at the top of a heap, so under sustained load RSS creeps up with memory that
is free: issue 21's soak saw the router's "free but held" bytes (mallinfo2) double from 15 to
30 MB in three minutes while the objects tracemalloc traced grew by 7 MB. An operator who
sets a memory limit reads RSS; `malloc_trim(0)` releases the free pages of every arena
(madvise), so RSS says what the process really holds. It costs a walk over the free lists,
a few milliseconds for a heap of a few hundred MB, once a minute.

Not glibc (musl, macOS): nothing to do, `trimmer()` is None.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger("sdcp_fast.heap")
TRIM_EVERY_S = 60.0


def trimmer() -> Callable[[], bool] | None:
    """glibc's malloc_trim(0) as a call that says whether memory went back, or None."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


async def trim_heap_every(seconds: float = TRIM_EVERY_S) -> None:
    """Run until cancelled: give freed heap back every `seconds` (0 or below: never)."""
    trim = trimmer()
    if trim is None or seconds <= 0:
        return
    while True:
        await asyncio.sleep(seconds)
        started = time.perf_counter()
        released = trim()
        log.debug("malloc_trim: %s in %.1f ms", "memory released" if released else "nothing to release",
                  1e3 * (time.perf_counter() - started))
