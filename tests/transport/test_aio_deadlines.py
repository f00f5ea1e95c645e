"""aio.Deadlines: `with deadlines.timeout(task, t)` behaves as `async with asyncio.timeout(t)`
(the servers' handler limit, the client's attempt), on asyncio's loop and on uvloop, while
many bounds share one loop timer."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvloop

from sdcp_fast.aio import Deadlines

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """Run a coroutine function to its end on a fresh loop of each kind."""
    def run_on(main):
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            return runner.run(main())
    return run_on


def _deadlines_bound(deadlines: dict):
    @contextlib.asynccontextmanager
    async def bound(delay_s):
        task = asyncio.current_task()
        if "it" not in deadlines:
            deadlines["it"] = Deadlines(task.get_loop())
        with deadlines["it"].timeout(task, delay_s) as entered:
            yield entered
    return bound


@pytest.fixture(params=["Deadlines", "asyncio.timeout"])
def bound(request):
    """Every behaviour below holds for a Deadlines bound and for what it stands for."""
    if request.param == "asyncio.timeout":
        return asyncio.timeout
    return _deadlines_bound({})


def test_a_block_done_in_time_returns_and_leaves_the_task_uncancelled(run, bound):
    async def main():
        async with bound(1.0):
            await asyncio.sleep(0.001)
            value = "v"
        async with bound(None):   # no limit
            await asyncio.sleep(0.001)
        assert asyncio.current_task().cancelling() == 0
        return value

    assert run(main) == "v"


def test_an_overdue_block_ends_in_timeout_error_at_its_deadline(run, bound):
    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with bound(0.05) as entered:
                await asyncio.sleep(5)
        took = loop.time() - started
        assert entered.expired()
        assert asyncio.current_task().cancelling() == 0   # the deadline's cancellation is taken back
        await asyncio.sleep(0.001)                          # and the task goes on
        return took

    assert 0.045 <= run(main) < 1.0


def test_a_deadline_already_past_expires_at_the_first_suspension(run, bound):
    async def main():
        with pytest.raises(TimeoutError):
            async with bound(-1.0):
                await asyncio.sleep(0)
                raise AssertionError("ran past an expired deadline")

    run(main)


def test_a_cancellation_from_elsewhere_stays_a_cancellation(run, bound):
    async def blocked(delay_s):
        async with bound(delay_s):
            await asyncio.sleep(5)

    async def main():
        for delay_s in (5.0, 0.02):   # before the deadline; and together with it
            task = asyncio.create_task(blocked(delay_s))
            await asyncio.sleep(0.03 if delay_s < 1 else 0.01)
            if delay_s < 1:
                assert task.done() and isinstance(task.exception(), TimeoutError)
                continue
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        # the deadline's cancellation under way, and one from elsewhere on top of it
        async def also_cancelled():
            async with bound(0.01):
                try:
                    await asyncio.sleep(5)
                finally:
                    asyncio.current_task().cancel()

        task = asyncio.create_task(also_cancelled())
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)


def test_a_block_that_swallows_the_cancellation_completes(run, bound):
    """As with asyncio.timeout: the block catches the CancelledError and goes on; nothing is
    raised at its end, and the task is not left cancelling."""
    async def main():
        async with bound(0.01) as entered:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                pass
        assert entered.expired()
        assert asyncio.current_task().cancelling() == 0

    run(main)


def test_each_of_many_concurrent_bounds_expires_at_its_own_deadline(run):
    """Different delays on one Deadlines, entered in any order: each task ends at its own
    deadline (not at another's, not late), those done in time are untouched."""
    outcomes: dict[str, tuple[str, float]] = {}

    async def main():
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop)
        started = loop.time()

        async def one(name, delay_s, work_s):
            task = asyncio.current_task()
            try:
                with deadlines.timeout(task, delay_s):
                    await asyncio.sleep(work_s)
                outcomes[name] = ("done", loop.time() - started)
            except TimeoutError:
                outcomes[name] = ("timeout", loop.time() - started)

        await asyncio.gather(one("long", 0.30, 5), one("short", 0.08, 5), one("quick", 0.30, 0.01),
                             one("middle", 0.16, 5), one("in-time", 0.16, 0.10))
        assert len(deadlines) == 0

    run(main)
    assert {name: kind for name, (kind, _) in outcomes.items()} == {
        "long": "timeout", "short": "timeout", "quick": "done", "middle": "timeout", "in-time": "done"}
    for name, expected in (("short", 0.08), ("middle", 0.16), ("long", 0.30)):
        assert expected - 0.005 <= outcomes[name][1] < expected + 0.25, (name, outcomes[name])


def test_bounds_with_one_delay_share_one_timer(run):
    """The point of Deadlines: a bound per request arms no timer of its own. Requests one
    after another with the same delay arm the loop timer once (for the first); an earlier
    deadline re-arms it, and a timer that fires with nothing due arms it for the earliest
    bound left."""
    async def main():
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop)
        armed = []
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):
            if getattr(callback, "__self__", None) is deadlines:   # not asyncio.sleep's
                armed.append(when)
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting_call_at
        try:
            task = asyncio.current_task()
            for _ in range(200):
                with deadlines.timeout(task, 10.0):
                    await asyncio.sleep(0)
            assert len(armed) == 1 and len(deadlines) == 0
            with deadlines.timeout(task, 0.02):   # earlier than the armed timer: re-armed
                await asyncio.sleep(0)
            assert len(armed) == 2
            # the timer still waits for that (ended) bound's deadline; when it fires, this
            # bound is not due yet: one more arming, for it, and it expires then
            with pytest.raises(TimeoutError):
                with deadlines.timeout(task, 0.05):
                    await asyncio.sleep(1)
            assert len(armed) == 3 and len(deadlines) == 0
        finally:
            loop.call_at = call_at
            deadlines.close()

    run(main)


def test_a_closed_deadlines_expires_nothing_more(run):
    async def main():
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop)
        task = asyncio.current_task()
        with deadlines.timeout(task, 0.01) as entered:
            deadlines.close()
            await asyncio.sleep(0.05)
        assert not entered.expired() and len(deadlines) == 0

    run(main)
