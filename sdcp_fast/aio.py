"""Small asyncio pieces every service uses: background tasks it owns, a lock per key.

    tasks = TaskSet()
    tasks.spawn(coro)                  # kept referenced (asyncio holds only weak ones)
    await tasks.cancel_all()           # cancel every task and wait (bounded) for them

    locks = KeyedLock()
    async with locks.hold(key): ...    # one holder per key; the lock is dropped when unused
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Hashable
from typing import Any


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really finished."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class TaskSet:
    """Background tasks of one owner: referenced until they end, cancelled together."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self, timeout: float = 2.0) -> None:
        """Cancel every task and wait up to `timeout` seconds for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


class KeyedLock:
    """One asyncio.Lock per key, kept only while a holder or a waiter uses it, so that
    per-session locks never outlive their sessions (bounded memory)."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, list[int]]] = {}   # key -> (lock, [users])

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)
