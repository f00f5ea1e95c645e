"""What the stores kept in local files (file_log.py, records_file.py) share: blocking file
work run in a worker thread under the store's timeout, and a directory fsync (a new file's
name survives a crash only once its directory is synced)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import Any

from .errors import StoreTimeout


async def in_thread(fn: Callable[..., Any], *args, timeout_s: float, what: str,
                    executor: Executor | None = None) -> Any:
    """`fn(*args)` in a worker thread (the loop's default pool, or `executor`); StoreTimeout
    after `timeout_s` (the thread may still finish the work: callers that must know read
    again)."""
    try:
        async with asyncio.timeout(timeout_s):   # not wait_for: no extra task per call
            if executor is not None:
                return await asyncio.get_running_loop().run_in_executor(executor, partial(fn, *args))
            return await asyncio.to_thread(fn, *args)
    except TimeoutError as exc:
        raise StoreTimeout(f"{what} exceeded {timeout_s}s") from exc


def fsync_dir(directory: Path, *, missing_ok: bool = False) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


def in_memory(directory: Path) -> bool:
    """Whether `directory` lies on a memory file system (its syncs cost nothing), from the
    mount table's longest mount point above it; False where that cannot be read."""
    try:
        path = os.path.realpath(directory)
        best, kind = "", ""
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, fields[2]
        return kind in MEMORY_FILE_SYSTEMS
    except OSError:
        return False
