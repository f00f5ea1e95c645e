"""Sessions that open together are prefilled in one packed pass: `aio.Gather` (batching,
order, per-item refusals, cost bound, cancellation), the backends' `open_many` (the same
K/V and rows as opening one by one; a refused prompt refuses only itself) and the verifier's
`TargetModel.prefill` under a burst of opens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sdcp_fast.aio import Gather
from sdcp_fast.core.problems import Kind, ProblemError
from sdcp_fast.models import load_backend
from sdcp_fast.models.base import InvalidTokens, open_many
from sdcp_fast.verifier.target import TargetModel


def test_gather_serves_callers_that_arrive_while_a_batch_runs_in_one_batch():
    async def main():
        lock, calls = asyncio.Lock(), []

        async def run_batch(items):
            calls.append(list(items))
            await asyncio.sleep(0.01)
            return [ValueError(item) if item == "bad" else item.upper() for item in items]

        gather = Gather(run_batch, hold=lock, cost=len, max_cost=6)
        first = asyncio.ensure_future(gather.submit("a"))
        await asyncio.sleep(0.001)            # "a" runs alone; the rest arrive meanwhile
        rest = [asyncio.ensure_future(gather.submit(x)) for x in ("bb", "bad", "cc", "dd")]
        assert await first == "A"
        assert await rest[0] == "BB" and await rest[2] == "CC" and await rest[3] == "DD"
        with pytest.raises(ValueError):       # a refused item fails its own caller only
            await rest[1]
        # arrival order; the cost bound (6) splits "bb", "bad" | "cc", "dd"
        assert calls == [["a"], ["bb", "bad"], ["cc", "dd"]]
        assert gather.batches == 3

    asyncio.run(main())


def test_gather_waits_for_announced_items_within_its_measured_bound():
    """Callers of one burst that submit a few loop turns apart: with their arrivals announced,
    the batch waits for them (one batch, not the first alone); an announced item that never
    comes delays a batch by at most company_share of the batch's measured cost."""
    async def main():
        lock, calls = asyncio.Lock(), []

        async def run_batch(items):
            calls.append(list(items))
            await asyncio.sleep(0.05 * sum(len(i) for i in items))   # 50 ms per unit of cost
            return items

        gather = Gather(run_batch, hold=lock, cost=len, company_share=0.5)
        assert await gather.submit("x") == "x"            # measured: 50 ms a unit
        calls.clear()

        async def caller(item, delay):
            arrival = gather.announce()
            try:
                await asyncio.sleep(delay)                 # its own reads first
                return await gather.submit(item, arrival)
            finally:
                arrival.done()

        results = await asyncio.gather(caller("aa", 0), caller("bb", 0.005), caller("cc", 0.012))
        assert results == ["aa", "bb", "cc"] and calls == [["aa", "bb", "cc"]]

        calls.clear()
        never = gather.announce()                          # announced, never submitted
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await gather.submit("dd") == "dd"
        waited = loop.time() - started - 0.1               # the batch itself: 2 units, 100 ms
        assert calls == [["dd"]]
        assert 0.04 <= waited < 0.09                       # half of 100 ms, not until it comes
        never.done()
        never.done()                                       # idempotent

    asyncio.run(main())


def test_gather_a_batch_that_raises_fails_its_callers_and_the_next_batch_still_runs():
    async def main():
        lock = asyncio.Lock()

        async def run_batch(items):
            if "boom" in items:
                raise RuntimeError("down")
            return items

        gather = Gather(run_batch, hold=lock)
        async with lock:                      # both wait for the lock: one batch
            a = asyncio.ensure_future(gather.submit("boom"))
            b = asyncio.ensure_future(gather.submit("x"))
            await asyncio.sleep(0.01)
        for f in (a, b):
            with pytest.raises(RuntimeError):
                await f
        assert await gather.submit("y") == "y"

    asyncio.run(main())


def test_gather_a_cancelled_caller_is_left_out_and_closing_cancels_the_waiting():
    async def main():
        lock, seen = asyncio.Lock(), []

        async def run_batch(items):
            seen.extend(items)
            return items

        gather = Gather(run_batch, hold=lock)
        async with lock:
            gone = asyncio.ensure_future(gather.submit("gone"))
            kept = asyncio.ensure_future(gather.submit("kept"))
            await asyncio.sleep(0.01)
            gone.cancel()
            await asyncio.sleep(0)
        assert await kept == "kept" and seen == ["kept"]
        async with lock:                      # the owner closes while callers wait
            waiting = asyncio.ensure_future(gather.submit("w"))
            await asyncio.sleep(0.01)
            gather._task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())


PROMPTS = [[5, 7, 9, 11, 13], [3, 1, 4, 1, 5, 9, 2, 6], [8], [2, 7, 1, 8, 2, 8, 1]]


@pytest.mark.parametrize("spec", ["tiny:demo-target"])
def test_open_many_equals_opening_one_by_one(spec):
    together, alone = load_backend(spec), load_backend(spec)
    sids = [bytes([n]) * 16 for n in range(len(PROMPTS))]
    assert open_many(together, list(zip(sids, PROMPTS, strict=True))) == [None] * len(PROMPTS)
    for sid, prompt in zip(sids, PROMPTS, strict=True):
        alone.open(sid, prompt)
    items = [(sid, (3, 4)) for sid in sids]
    torch.testing.assert_close(together.score(items), alone.score(items), atol=1e-5, rtol=0)


def test_open_many_a_refused_prompt_refuses_only_itself():
    backend = load_backend("tiny:demo-target")
    bad = [backend.vocab_size + 5]
    items = [(b"a" * 16, PROMPTS[0]), (b"b" * 16, bad), (b"c" * 16, PROMPTS[1]), (b"a" * 16, PROMPTS[2])]
    errors = open_many(backend, items)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], InvalidTokens)
    assert errors[3] is not None            # the session exists already
    assert sorted(backend.sessions()) == [b"a" * 16, b"c" * 16]
    assert backend.committed(b"a" * 16) == PROMPTS[0]


def test_a_burst_of_opens_prefills_in_few_passes_and_each_session_holds_its_prompt():
    async def main():
        model = TargetModel(load_backend("tiny:demo-target"))
        sids = [bytes([n]) * 16 for n in range(12)]
        prompts = [PROMPTS[n % len(PROMPTS)] + [n] for n in range(12)]
        await asyncio.gather(*(model.prefill(sid, p, None, reopen=False) for sid, p in zip(sids, prompts, strict=True)))
        assert model.prefills == 12
        assert model.opening.batches <= 2     # the first alone, the rest gathered meanwhile
        for sid, p in zip(sids, prompts, strict=True):
            assert model.backend.committed(sid) == p
        # a refused prompt in a burst: a 400 for it, the others open
        refused = [model.backend.vocab_size + 1]
        results = await asyncio.gather(
            model.prefill(b"x" * 16, PROMPTS[0], None, reopen=False),
            model.prefill(b"y" * 16, refused, None, reopen=False),
            return_exceptions=True)
        assert results[0] is None and isinstance(results[1], ProblemError)
        assert results[1].problem.kind is Kind.BAD_REQUEST
        assert model.backend.committed(b"x" * 16) == PROMPTS[0]

    asyncio.run(main())


def test_a_burst_prefill_is_observed_over_the_tokens_it_computed():
    """The pass-cost model learns from a burst's prefill the tokens computed, not those a
    session copied from another (prompts alike: prefix_cache.py)."""
    class Copying:
        """open_many that says it copied 10 positions of each prompt after the first."""

        prefix_tokens_copied = 5

        def open_many(self, items):
            self.prefix_tokens_copied += 10 * (len(items) - 1)
            return [None] * len(items)

    async def main():
        model = TargetModel(Copying())
        seen = []
        model.observe_pass = lambda tokens, seconds: seen.append(tokens)
        await asyncio.gather(*(model.prefill(bytes([n]) * 16, list(range(30)), None, reopen=False)
                               for n in range(4)))
        assert len(seen) == model.opening.batches
        assert sum(seen) == 4 * 30 - 10 * (4 - model.opening.batches)

    asyncio.run(main())

