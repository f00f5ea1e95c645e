"""aio.within(coro, t) behaves as `async with asyncio.timeout(t): await coro`, and sets no
timeout up for a coroutine that completes without suspending (the engine's group commit on
the loop)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sdcp_fast.aio import within


async def _plain(coro, timeout_s):
    async with asyncio.timeout(timeout_s):
        return await coro


@pytest.fixture(params=[within, _plain], ids=["within", "asyncio.timeout"])
def bounded(request):
    """Every behaviour below holds for `within` and for what it stands for."""
    return request.param


def test_a_coroutine_that_does_not_suspend_sets_no_timeout_up(monkeypatch):
    async def immediate():
        return 7

    def no_timeout(*_args, **_kwargs):
        raise AssertionError("a timeout was set up")

    async def main():
        monkeypatch.setattr(asyncio, "timeout", no_timeout)
        return await within(immediate(), 1.0)

    assert asyncio.run(main()) == 7


def test_values_and_errors_come_back_as_they_would_under_the_timeout(bounded):
    async def suspends_then(value):
        await asyncio.sleep(0)        # a bare yield
        await asyncio.sleep(0.001)    # a future
        return value

    async def fails_at_once():
        raise KeyError("now")

    async def fails_later():
        await asyncio.sleep(0.001)
        raise KeyError("later")

    async def main():
        assert await bounded(suspends_then("v"), 1.0) == "v"
        with pytest.raises(KeyError, match="now"):
            await bounded(fails_at_once(), 1.0)
        with pytest.raises(KeyError, match="later"):
            await bounded(fails_later(), 1.0)

    asyncio.run(main())


async def _waits_long(seen: list[str]) -> None:
    """Sleeps 10 s; says when it is cancelled and when it cleans up."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        seen.append("cancelled")
        raise
    finally:
        seen.append("cleaned up")


def _seconds_to_time_out(bounded, coro, timeout_s: float) -> float:
    """Run `bounded(coro, timeout_s)`, which must raise TimeoutError; how long that took."""
    async def main():
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await bounded(coro, timeout_s)
        return time.monotonic() - started

    return asyncio.run(main())


def test_a_coroutine_past_its_deadline_is_cancelled_and_times_out(bounded):
    seen = []
    elapsed = _seconds_to_time_out(bounded, _waits_long(seen), 0.05)
    assert seen == ["cancelled", "cleaned up"]
    assert 0.04 <= elapsed < 5


def test_the_deadline_counts_from_the_call_not_from_the_first_suspension(bounded):
    async def busy_then_waits():
        time.sleep(0.08)          # runs past the whole bound before its first suspension
        await asyncio.sleep(10)

    # cancelled at its first suspension, not 0.05 s after it
    assert _seconds_to_time_out(bounded, busy_then_waits(), 0.05) < 1.0


def test_a_cancellation_from_outside_is_a_cancellation_not_a_timeout(bounded):
    seen = []

    async def main():
        task = asyncio.create_task(bounded(_waits_long(seen), 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled", "cleaned up"]


def test_a_coroutine_may_catch_the_deadlines_cancellation_and_return(bounded):
    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "caught"

    async def main():
        # as under asyncio.timeout: the cancellation was swallowed, so its value comes back
        return await bounded(stubborn(), 0.02)

    assert asyncio.run(main()) == "caught"
