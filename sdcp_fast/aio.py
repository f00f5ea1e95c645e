"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really finished."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
