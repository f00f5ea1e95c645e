"""Small asyncio pieces every service uses: background tasks it owns, a lock per key.

    loop = LoopTask(self._run, "name")
    loop.start()                       # once; a second start while it runs does nothing
    await loop.stop()                  # cancel it and wait until it has ended

    tasks = TaskSet()
    tasks.spawn(coro)                  # kept referenced (asyncio holds only weak ones)
    await tasks.cancel_all()           # cancel every task and wait (bounded) for them

    locks = KeyedLock()
    async with locks.hold(key): ...    # one holder per key; the lock is dropped when unused

    offload = Offload()
    await offload.run(fn, *args, units=n)   # fn in a worker thread, or here when measured cheap

    run(main())                        # asyncio.run, on uvloop when it is installed

    value = await within(coro, timeout_s)   # asyncio.timeout's bound, set up only if coro suspends
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable
from typing import Any

EVENT_LOOP_VAR = "SDCP_EVENT_LOOP"   # "asyncio": asyncio's own loop even where uvloop is installed


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)` on uvloop when it is installed (a declared dependency off Windows):
    its event loop and TLS layer are compiled, where asyncio's are Python, and a process whose
    requests are small spends much of its time in them (bench/RESULTS.md, "A lean round").
    SDCP_EVENT_LOOP=asyncio keeps asyncio's own loop (the benchmarks compare the two)."""
    if os.environ.get(EVENT_LOOP_VAR, "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            logging.getLogger("sdcp_fast").debug("event loop: uvloop %s", uvloop.__version__)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really finished."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class LoopTask:
    """The one long-running task of an owner (a batcher's loop), started and stopped by it."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, Any]], name: str):
        self._run = run
        self._name = name
        self._task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None


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


class Offload:
    """Blocking calls of one kind (a model's forward pass, a verify launch) run in a worker
    thread so the event loop keeps serving, except those measured cheaper than the hop.

    Handing a call to a worker thread and back costs two wake-ups: tens of microseconds on
    a quiet machine, milliseconds on a loaded one, where the worker must wait for a core.
    For a call that itself takes microseconds (a table model, a small verify batch on CPU)
    the hop is most of a round. So each call's own duration per unit of work (rows, jobs) is
    tracked (EWMA), and a call whose estimate, times its units, is under `inline_below_s`
    runs on the event loop: the loop is held for less than a hop would have cost. The first
    call, and any call of a kind measured slow, goes to a thread; a call that grows slow
    moves itself back to threads by the same measurement.
    """

    def __init__(self, inline_below_s: float | None = None, alpha: float = 0.25):
        if inline_below_s is None:   # SDCP_INLINE_BELOW_US=0: every call in a thread
            inline_below_s = float(os.environ.get("SDCP_INLINE_BELOW_US", "300")) / 1e6
        self.inline_below_s = inline_below_s
        self.alpha = alpha
        self.per_unit: float | None = None   # seconds per unit of work, measured

    def inline(self, units: int) -> bool:
        return self.per_unit is not None and self.per_unit * max(units, 1) < self.inline_below_s

    async def run(self, fn, *args: Any, units: int = 1) -> Any:
        if self.inline(units):
            return self.timed(units, fn, *args)
        return await asyncio.to_thread(self.timed, units, fn, *args)

    def timed(self, units: int, fn, *args: Any) -> Any:
        """`fn(*args)` here, its duration taken into the estimate (for callers that pick the
        thread themselves)."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            per_unit = (time.perf_counter() - started) / max(units, 1)
            self.per_unit = per_unit if self.per_unit is None else \
                self.per_unit + self.alpha * (per_unit - self.per_unit)


async def within(coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
    """`async with asyncio.timeout(timeout_s): return await coro`, where the timeout (a timer
    armed and cancelled, a current-task lookup, two get_running_loop() calls, each a getpid()
    system call on Python 3.11) is set up only if `coro` suspends: the coroutine runs here up
    to its first suspension, and only what remains is awaited under the deadline, counted from
    the call. A timeout can only act at a suspension, so the outcome is the same: a coroutine
    that completes without suspending returns its value (or raises) exactly as it would
    under the timeout, and one that suspends is cancelled at the same deadline."""
    started = time.monotonic()
    try:
        yielded = coro.send(None)
    except StopIteration as done:
        return done.value
    async with asyncio.timeout(timeout_s - (time.monotonic() - started)):
        return await _Rest(coro, yielded)


class _Rest:
    """The rest of a coroutine already started (`within`): what it yields goes to the awaiting
    task, and what the task sends or throws goes back into it, as `await` itself would do."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any):
        self._coro = coro
        self._yielded = yielded

    def __await__(self):
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:   # a cancellation (the deadline's), thrown into the coroutine
                try:
                    yielded = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as done:
                    return done.value
