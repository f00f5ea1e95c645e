"""What the stores kept in local files (file_log.py, records_file.py) share: blocking file
work run in a worker thread under the store's timeout, and a directory fsync (a new file's
name survives a crash only once its directory is synced)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import StoreTimeout


async def in_thread(fn: Callable[..., Any], *args, timeout_s: float, what: str) -> Any:
    """`fn(*args)` in a worker thread; StoreTimeout after `timeout_s` (the thread may still
    finish the work: callers that must know read again)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
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


