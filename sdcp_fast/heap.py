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
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("sdcp_fast.heap")
ENV = "SDCP_MALLOC_ARENAS"
DEFAULT_ARENAS = 2
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
