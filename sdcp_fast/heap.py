"""glibc malloc's arenas in a serving process: capped, so free memory is shared, not stranded.

glibc gives each thread that allocates while another holds an arena's lock an arena of its
own, up to 8 per core. A service's worker threads (record-table and commit-log calls, forward
passes in `Offload`) each then grow their own heap for their transient buffers and keep its
free memory: one arena can only give its top back, and none lends to another. The soak
(bench/bench_soak.py) saw a router's worker-thread arenas go from 1.7 to 15 MB in three
minutes while the bytes in use did not grow. Two arenas (the event loop's and one the workers
share) is the usual setting for Python servers (MALLOC_ARENA_MAX=2): the GIL serialises most
allocation anyway, and glibc's per-thread caches take the small ones without a lock.

SDCP_MALLOC_ARENAS=N sets another cap (0 leaves glibc's default); MALLOC_ARENA_MAX in the
environment, read by glibc itself at start, is left alone.

Within an arena, free memory between chunks still in use stays part of the process: glibc
gives back only the top of a heap, on `free`, so a long-lived chunk above freed ones keeps
them resident. A serving process that runs for days turns its memory over that way (request
buffers, frames, records), and its RSS creeps up while the bytes in use stay flat (the
routers of issue 38's soaks, bench/RESULTS.md). So every serving process asks glibc to
return the free pages of every arena (`malloc_trim(0)`, which since glibc 2.8 releases whole
free pages inside a heap, not only its top) every `TRIM_EVERY_S`, in a worker thread: the
call takes each arena's lock while it walks the free lists.
SDCP_MALLOC_TRIM_S=N sets another period (0: never).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os

log = logging.getLogger("sdcp_fast.heap")
ENV = "SDCP_MALLOC_ARENAS"
TRIM_ENV = "SDCP_MALLOC_TRIM_S"
DEFAULT_ARENAS = 2
TRIM_EVERY_S = 60.0       # a serving process's period of malloc_trim
M_ARENA_MAX = -8          # mallopt's parameter number (malloc.h)


def cap_arenas() -> int | None:
    """Cap glibc's arenas for this process (call before worker threads start); the cap set,
    or None where nothing was set (not glibc, MALLOC_ARENA_MAX given, or 0 asked)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return None
    try:
        arenas = int(os.environ.get(ENV, DEFAULT_ARENAS))
    except ValueError:
        log.warning("%s=%r is not a number; glibc's default arenas kept", ENV, os.environ[ENV])
        return None
    if arenas <= 0:
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None               # not glibc (musl, macOS): nothing to cap
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) refused", arenas)
        return None
    return arenas


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None               # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim() -> bool | None:
    """Return the free pages of every arena to the system now; True where some were, None
    where this is not glibc."""
    call = _malloc_trim()
    return None if call is None else bool(call(0))


def trim_period() -> float:
    """Seconds between a serving process's trims (SDCP_MALLOC_TRIM_S; 0: none)."""
    try:
        return max(0.0, float(os.environ.get(TRIM_ENV, TRIM_EVERY_S)))
    except ValueError:
        log.warning("%s=%r is not a number; every %.0f s kept", TRIM_ENV, os.environ[TRIM_ENV], TRIM_EVERY_S)
        return TRIM_EVERY_S


async def keep_trimmed(period_s: float) -> None:
    """Trim every `period_s` seconds until cancelled (a serving process's task)."""
    if period_s <= 0 or _malloc_trim() is None:
        return
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(trim)
