"""Drafting ahead: the batcher's `settle` (a look-ahead stops at its verdict with the tokens
it has) and the session's measured odds that a look-ahead is used."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from sdcp_fast.core.messages import RULE_GREEDY
from sdcp_fast.drafter.drafting import DraftBatcher, DraftRequest
from sdcp_fast.drafter.session import LookaheadOdds

VOCAB = 16


class SlowCounter:
    """A draft backend whose next token is (last + 1) mod VOCAB; each score call takes one
    permit (`release(n)` gives n), so a test lets exactly the steps it wants run and holds
    the next one under way, and takes a few milliseconds, so the batcher runs it in a worker
    thread (a call measured cheaper would run on the loop, which a held step would block)."""

    def __init__(self):
        self.permits = threading.Semaphore(0)
        self.calls = 0

    def release(self, steps: int = 1000) -> None:
        self.permits.release(steps)

    def score(self, items):
        self.calls += 1
        assert self.permits.acquire(timeout=10)
        time.sleep(0.003)
        rows = []
        for _, x in items:
            for t in [0, *x]:
                row = torch.zeros(VOCAB)
                row[(t + 1) % VOCAB] = 1.0
                rows.append(row)
        return torch.stack(rows)


def request(session: bytes, want: int) -> DraftRequest:
    return DraftRequest(session, [], want, RULE_GREEDY, None, torch.Generator())


def test_settle_outside_a_step_resolves_at_once():
    async def go():
        backend = SlowCounter()
        batcher = DraftBatcher(backend)
        batcher.start()
        try:
            blocker = request(b"a", 1)            # holds the loop in a step
            first = asyncio.create_task(batcher.draft(blocker))
            while backend.calls == 0:
                await asyncio.sleep(0.001)
            r = request(b"a", 5)                  # same session: waits for the next step
            task = asyncio.create_task(batcher.draft(r))
            await asyncio.sleep(0.01)
            settled = await asyncio.wait_for(batcher.settle(r), 1)
            assert settled.tokens == [] and (await task) is r
            backend.release()
            await first
        finally:
            backend.release()
            await batcher.stop()
    asyncio.run(go())


def test_settle_in_a_step_keeps_that_steps_token():
    async def go():
        backend = SlowCounter()
        batcher = DraftBatcher(backend)
        batcher.start()
        try:
            r = request(b"s", 6)
            task = asyncio.create_task(batcher.draft(r))
            backend.release(2)                    # two steps run; the third is held under way
            # (its call has begun: calls counts a call before it waits for its permit)
            while len(r.tokens) < 2 or backend.calls < 3:
                await asyncio.sleep(0.001)
            have = len(r.tokens)
            settling = asyncio.create_task(batcher.settle(r))
            await asyncio.sleep(0.01)
            assert not settling.done()            # waits for the step under way, not for all 6
            backend.release()
            await asyncio.wait_for(settling, 2)
            assert len(r.tokens) == have + 1 == 3
            assert r.tokens == [(k + 1) % VOCAB for k in range(len(r.tokens))]
            assert (await task) is r
        finally:
            backend.release()
            await batcher.stop()
    asyncio.run(go())


def test_odds_follow_full_acceptance_and_guesses():
    odds = LookaheadOdds()
    for _ in range(30):
        odds.observe(4, 4, None)                  # every round accepts all: no guess checked yet
    assert odds.hit == pytest.approx(1.0, abs=0.01)
    for _ in range(30):
        odds.observe(4, 4, False)                 # the guess is always wrong
    assert odds.hit < 0.01
    for _ in range(30):
        odds.observe(1, 4, None)                  # partial rounds: the full rate falls
    assert odds.full < 0.01
