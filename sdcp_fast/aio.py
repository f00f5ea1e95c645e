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
    Offload(compute=True)              # ... on the process's compute thread, the host's free cores
    await compute(fn, *args)           # a long compute call (a prefill) on the compute thread
    gather = Gather(run_batch, hold=lock)   # calls arriving together served by one batch
    await gather.submit(item)

    run(main())                        # asyncio.run, on uvloop when it is installed

    value = await within(coro, timeout_s)   # asyncio.timeout's bound, set up only if coro suspends

    deadlines = Deadlines(loop)
    with deadlines.timeout(task, delay_s): ...   # asyncio.timeout for `task`, one timer for all
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
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


_COMPUTE: ThreadPoolExecutor | None = None
_COMPUTE_MADE = threading.Lock()


def compute_executor() -> ThreadPoolExecutor:
    """The process's one compute thread, started on first use: every compute call of the
    process runs there, so that one thread alone keeps an OpenMP team (cores.py says why)."""
    global _COMPUTE
    with _COMPUTE_MADE:
        if _COMPUTE is None:
            _COMPUTE = ThreadPoolExecutor(1, thread_name_prefix="sdcp-compute", initializer=_compute_started)
        return _COMPUTE


def _compute_started() -> None:
    from .cores import compute_thread_started  # torch: only processes that compute import it
    compute_thread_started()


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

    A compute call (`compute=True`: torch work) goes to the process's compute thread, not to
    the loop's pool, and takes the host's free cores there (cores.py); measured cheap, it runs
    on the loop thread's own single torch thread (`cores.single_threaded_loop`).
    """

    def __init__(self, inline_below_s: float | None = None, alpha: float = 0.25, *,
                 compute: bool = False):
        if inline_below_s is None:   # SDCP_INLINE_BELOW_US=0: every call in a thread
            inline_below_s = float(os.environ.get("SDCP_INLINE_BELOW_US", "300")) / 1e6
        self.inline_below_s = inline_below_s
        self.alpha = alpha
        self.compute = compute               # torch work: on the compute thread, the host's free cores
        self.per_unit: float | None = None   # seconds per unit of work, measured

    def inline(self, units: int) -> bool:
        return self.per_unit is not None and self.per_unit * max(units, 1) < self.inline_below_s

    async def run(self, fn, *args: Any, units: int = 1) -> Any:
        if self.inline(units):
            return self.timed(units, fn, *args)
        if self.compute:
            return await asyncio.get_running_loop().run_in_executor(
                compute_executor(), partial(self.timed, units, fn, *args, in_thread=True))
        return await asyncio.to_thread(self.timed, units, fn, *args, in_thread=True)

    def timed(self, units: int, fn, *args: Any, in_thread: bool = False) -> Any:
        """`fn(*args)` here, its duration taken into the estimate (for callers that pick the
        thread themselves). A compute call in a worker thread runs on the cores it takes
        (`cores.compute_threads`, waiting for a free one); on the event loop it takes none."""
        started = time.perf_counter()
        try:
            if not (self.compute and in_thread):
                return fn(*args)
            from .cores import compute_threads  # torch: only processes that compute import it
            with compute_threads(wait=True):
                return fn(*args)
        finally:
            per_unit = (time.perf_counter() - started) / max(units, 1)
            self.per_unit = per_unit if self.per_unit is None else \
                self.per_unit + self.alpha * (per_unit - self.per_unit)


class Gather:
    """Calls of one kind that arrive while the previous ones wait or run are served together:
    one `run_batch(items)` for all of them, under `hold` (an asyncio.Lock the batch needs).
    The prefills of sessions that open at once, say, become one packed pass instead of one
    pass each, which also holds the model's lock once instead of once per session.

        gather = Gather(run_batch, hold=lock, cost=len, max_cost=4096)
        result = await gather.submit(item)

    `run_batch` returns one result per item, in order; a result that is an exception is
    raised to that item's caller alone. A batch takes the items waiting when it gets `hold`,
    in arrival order, up to `max_cost` (the first item always); the rest wait for the next.
    If `run_batch` raises, every caller of that batch gets the exception. A caller that is
    cancelled stops waiting; an item already taken into a batch still runs.

    Items on their way: a caller that will submit after some awaits of its own (a session
    open reads its commit log and prompt first) says so at once, `arrival = gather.announce()`,
    and `arrival.done()` once it has submitted or will not (idempotent). A batch about to
    form while announced items are still on their way waits for them, up to `company_share`
    of what the waiting items' batch is measured to cost (seconds per unit of cost, an
    average over the batches run): callers of one burst that arrive a few loop turns apart
    then share one batch, instead of the first running alone and the rest waiting for it
    (a whole batch's cost later). Nothing announced, or no batch measured yet: no wait."""

    def __init__(self, run_batch: Callable[[list], Coroutine[Any, Any, list]], *,
                 hold: asyncio.Lock, cost: Callable[[Any], int] = lambda item: 1,
                 max_cost: int | None = None, company_share: float = 0.5):
        self.run_batch = run_batch
        self.hold = hold
        self.cost = cost
        self.max_cost = max_cost
        self.company_share = company_share
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._announced = 0                       # arrivals announced and not yet done
        self._arrived = asyncio.Event()           # set when an announced arrival is done
        self.seconds_per_cost: float | None = None   # measured over the batches run
        self.batches = 0   # batches run (for tests and metrics)

    def announce(self) -> Arrival:
        """An item that will be submitted (or not) after its caller's own awaits."""
        self._announced += 1
        return Arrival(self._arrival_done)

    def _arrival_done(self) -> None:
        self._announced -= 1
        self._arrived.set()

    async def submit(self, item: Any, arrival: Arrival | None = None) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if arrival is not None:
            arrival.done()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _await_company(self) -> None:
        """Wait while announced items are on their way, within the waiting batch's bound."""
        if self._announced <= 0 or self.seconds_per_cost is None or self.company_share <= 0:
            return
        cost = sum(self.cost(item) for item, future in self._waiting if not future.done())
        if self.max_cost is not None and cost >= self.max_cost:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.company_share * self.seconds_per_cost * cost
        while self._announced > 0 and (left := deadline - loop.time()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _observe(self, batch: list[tuple[Any, asyncio.Future]], seconds: float) -> None:
        per_cost = seconds / max(1, sum(self.cost(item) for item, _ in batch))
        self.seconds_per_cost = per_cost if self.seconds_per_cost is None else \
            self.seconds_per_cost + 0.25 * (per_cost - self.seconds_per_cost)

    def _take(self) -> list[tuple[Any, asyncio.Future]]:
        self._waiting = [(item, f) for item, f in self._waiting if not f.done()]
        taken, total = [], 0
        for item, future in self._waiting:
            total += self.cost(item)
            if taken and self.max_cost is not None and total > self.max_cost:
                break
            taken.append((item, future))
        del self._waiting[:len(taken)]
        return taken

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await asyncio.sleep(0)   # callers of this loop turn join the batch
                await self._await_company()
                async with self.hold:
                    batch = self._take()
                    if not batch:
                        continue
                    self.batches += 1
                    started = time.perf_counter()
                    try:
                        results = await self.run_batch([item for item, _ in batch])
                        self._observe(batch, time.perf_counter() - started)
                    except Exception as exc:
                        for _, future in batch:
                            _settle(future, exc)
                        continue
                    except BaseException:
                        for _, future in batch:
                            future.cancel()
                        raise
                for (_, future), result in zip(batch, results, strict=True):
                    _settle(future, result)
        finally:   # cancelled (the owner is closing): nobody is left waiting
            for _, future in self._waiting:
                future.cancel()
            self._waiting.clear()


class Arrival:
    """An item announced to a `Gather` before its caller can submit it (`Gather.announce`)."""

    def __init__(self, on_done: Callable[[], None]):
        self.on_done = on_done   # the gather's count of arrivals on their way, told once
        self.pending = True

    def done(self) -> None:
        """Submitted, or not coming: the gather no longer waits for it (once)."""
        if self.pending:
            self.pending = False
            self.on_done()


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


async def compute(fn, *args: Any) -> Any:
    """`fn(*args)` on the compute thread, on the host's free cores (a prefill: always long)."""
    return await asyncio.get_running_loop().run_in_executor(
        compute_executor(), partial(Offload(compute=True).timed, 1, fn, *args, in_thread=True))


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


class Deadlines:
    """`asyncio.timeout` for the many tasks of one owner on one event loop (a connection's
    requests, a client's attempts), under one loop timer. Each asyncio.timeout arms a loop
    timer and cancels it again (with uvloop a libuv timer handle made and closed), and looks
    up the running loop: about 6 us of a round's CPU, twice per round. Here a bound is an
    entry in a dict, and the one timer is armed for the earliest deadline; when it fires, the
    bounds due by then are expired and it is armed again for the earliest one left. With one
    delay for all (a server's handler limit), nearly every bound has ended before the timer
    fires, so it fires about once per delay.

    `timeout(task, delay_s)` answers what `asyncio.timeout(delay_s)` does when `task` enters
    it: past the deadline the task is cancelled, and the cancellation leaves the `with` block
    as TimeoutError (unless the task was also cancelled from elsewhere: then it stays a
    CancelledError). `task` must be the task that runs the block. None: no limit."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._bounds: dict[Bound, None] = {}   # entered and not yet left nor expired
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf   # when the timer fires (inf: not armed)

    def timeout(self, task: asyncio.Task[Any], delay_s: float | None) -> Bound:
        if delay_s is None:
            return Bound(self, task, None)
        return Bound(self, task, self.loop.time() + delay_s, due=delay_s <= 0)

    def close(self) -> None:
        """Stop the timer: the bounds still entered no longer expire (their owner is going)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = math.inf
        self._bounds.clear()

    def __len__(self) -> int:
        return len(self._bounds)

    def _enter(self, bound: Bound, when: float, due: bool) -> None:
        self._bounds[bound] = None
        if due:   # as asyncio.timeout: expired before the block's first suspension resumes
            self.loop.call_soon(self._expire, bound)
            return
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(when, self._fire)
            self._timer_at = when

    def _expire(self, bound: Bound) -> None:
        if self._bounds.pop(bound, False) is None:   # still entered
            bound.expire()

    def _fire(self) -> None:
        # The loop ran this timer, armed for `_timer_at`: a bound due by then is due now, as
        # asyncio.timeout's own timer for that moment would have run now (uvloop's clock
        # counts whole milliseconds: `loop.time()` may still read a little earlier).
        due_by = self._timer_at
        self._timer = None
        self._timer_at = math.inf
        bounds = self._bounds
        due = [bound for bound in bounds if bound.when <= due_by]
        for bound in due:
            del bounds[bound]
            bound.expire()
        if bounds:
            earliest = min(bound.when for bound in bounds)
            self._timer = self.loop.call_at(earliest, self._fire)
            self._timer_at = earliest


class Bound:
    """One `Deadlines.timeout`: a synchronous context manager for a block of a coroutine."""

    __slots__ = ("_deadlines", "_task", "when", "_due", "_cancelling", "_expired")

    def __init__(self, deadlines: Deadlines, task: asyncio.Task[Any], when: float | None, due: bool = False):
        self._deadlines = deadlines
        self._task = task
        self.when = when
        self._due = due   # the deadline has passed already
        self._cancelling = 0
        self._expired = False

    def expired(self) -> bool:
        """Whether the deadline passed and the block's task was cancelled for it."""
        return self._expired

    def __enter__(self) -> Bound:
        if self.when is not None:
            self._cancelling = self._task.cancelling()
            self._deadlines._enter(self, self.when, self._due)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not self._expired:
            if self.when is not None:
                self._deadlines._bounds.pop(self, None)
            return
        # asyncio.timeout's rule: the deadline's own cancellation becomes TimeoutError;
        # the cancellation is taken back either way, as it did not come from the caller
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()
