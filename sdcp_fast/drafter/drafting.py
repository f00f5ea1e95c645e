"""Batched drafting: every session's next draft token in one forward pass of the draft model.

Sessions ask for `want` more tokens on top of their committed sequence plus the tokens they
already drafted (`base`). The batcher runs one loop: each step scores the last position of
every active request in one `backend.score` call, picks one token per request, and resolves
the requests that have all they asked for. Requests that arrive while a step runs join the
next step (continuous batching), so a session never waits for another session's proposal
to finish.

Picking a token (section 6.2 and 6.4):
- rule 1: the argmax of the draft logits (ties to the smallest id), no q rows;
- rule 2: q = the session's sampling profile applied to the draft logits
  (`kernels.target_probs`), and the token drawn from exactly that fp32 row by inverse CDF
  (`kernels.sample`, the verifier's own rule) with a uniform from the session's own
  generator (never the verifier's HMAC derivation). The row is what the drafter publishes
  as q_rows, so q[i](x[i]) > 0 always holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..aio import Gather, LoopTask, Offload, compute
from ..core.messages import RULE_GREEDY, Sampling, transform_of
from ..models.base import open_many

log = logging.getLogger("sdcp_fast.drafter.drafting")


@dataclass(eq=False)
class DraftRequest:
    session: bytes
    base: list[int]                 # tokens already drafted beyond the committed sequence
    want: int                       # how many more tokens to draft
    rule: int
    sampling: Sampling | None
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)        # [want] drafted tokens
    rows: list[torch.Tensor] = field(default_factory=list)  # [want] x fp32 [V] q rows (rule 2)
    future: asyncio.Future | None = None
    cancelled: bool = False
    seconds: float = 0.0            # forward time attributed to this request

    def cancel(self) -> None:
        self.cancelled = True
        if self.future is not None and not self.future.done():
            self.future.cancel()


class DraftBatcher:
    """One loop over the draft backend; every backend call of the drafter goes through
    `model_lock`, since backends are not thread-safe."""

    def __init__(self, backend, *, max_batch: int = 32):
        self.backend = backend
        self.max_batch = max_batch
        self.model_lock = asyncio.Lock()
        self._queue: asyncio.Queue[DraftRequest] = asyncio.Queue()
        self._loop = LoopTask(self._run, "draft-batcher")
        self.busy_seconds = 0.0      # forward time, for the load figure
        self.active = 0              # requests in the step under way
        self.steps = 0               # forward passes run
        self.rows = 0                # tokens drafted over all steps (rows / steps = batching)
        self.widest = 0              # most sessions drafted in one pass
        self._in_step: set[int] = set()   # id() of the requests in the step under way
        self._stepping = Offload(compute=True)   # on the free cores; a step cheaper than a thread hop on the loop
        # prefills of sessions that start together: one packed pass (the lock held once)
        self.opening = Gather(self._open_batch, hold=self.model_lock,
                              cost=lambda item: len(item[1]),
                              max_cost=getattr(backend, "max_batch_tokens", None))

    async def _open_batch(self, items: list[tuple[bytes, list[int]]]) -> list:
        return await compute(open_many, self.backend, items)

    async def open(self, session: bytes, prompt: list[int]) -> None:
        """`backend.open` (a prefill), gathered with the prefills of sessions opening now."""
        await self.opening.submit((session, prompt))

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def draft(self, request: DraftRequest) -> DraftRequest:
        """Resolve when `request.want` tokens (and rows) are drafted."""
        if request.want <= 0:
            return request
        request.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    async def settle(self, request: DraftRequest) -> DraftRequest:
        """Stop drafting `request` and resolve it with the tokens it has: after the step under
        way when that step includes it (its token is as good as drafted), else at once. For a
        look-ahead whose verdict has arrived: the next proposal should not wait for tokens
        beyond the ones already drafted when `build` can draft the rest in a fresher batch."""
        future = request.future
        if future is None or future.done():
            return request
        if id(request) in self._in_step:
            request.want = len(request.tokens) + 1
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(future)
            return request
        request.want = len(request.tokens)
        request.cancelled = True          # the loop drops it from waiting and active
        future.set_result(request)
        return request

    async def _run(self) -> None:
        active: list[DraftRequest] = []
        waiting: list[DraftRequest] = []     # a second request of a session already stepping
        while True:
            if not active and not waiting:
                active.append(await self._queue.get())
            while self._queue.qsize():
                waiting.append(self._queue.get_nowait())
            sessions = {r.session for r in active}
            for r in list(waiting):
                if len(active) < self.max_batch and r.session not in sessions:
                    active.append(r)
                    sessions.add(r.session)
                    waiting.remove(r)
            active = [r for r in active if not r.cancelled]
            waiting = [r for r in waiting if not r.cancelled]
            if not active:
                continue
            self.active = len(active)
            try:
                await self._step(active)
            except Exception as exc:   # a backend failure: fail the requests, keep the loop
                log.exception("draft step over %d sessions failed", len(active))
                for r in active:
                    if r.future is not None and not r.future.done():
                        r.future.set_exception(exc)
                active = []
                continue
            finally:
                self.active = 0
            still = []
            for r in active:
                if len(r.tokens) >= r.want:
                    if r.future is not None and not r.future.done():
                        r.future.set_result(r)
                elif not r.cancelled:
                    still.append(r)
            active = still

    async def _step(self, batch: list[DraftRequest]) -> None:
        items = [(r.session, r.base + r.tokens) for r in batch]
        started = time.perf_counter()
        self._in_step = {id(r) for r in batch}
        try:
            async with self.model_lock:
                last = await self._stepping.run(self._last_rows, items, units=len(items))
        finally:
            self._in_step = set()
        elapsed = time.perf_counter() - started
        self.busy_seconds += elapsed
        self.steps += 1
        self.rows += len(batch)
        self.widest = max(self.widest, len(batch))
        for n, r in enumerate(batch):
            r.seconds += elapsed / len(batch)
            token, row = pick(last[n], r.rule, r.sampling, r.generator)
            r.tokens.append(token)
            if row is not None:
                r.rows.append(row)

    def _last_rows(self, items: list[tuple[bytes, list[int]]]) -> torch.Tensor:
        logits = self.backend.score(items)           # [sum(len(x) + 1), V]
        ends, offset = [], 0
        for _, x in items:
            offset += len(x) + 1
            ends.append(offset - 1)
        return logits[torch.tensor(ends, dtype=torch.long)]   # [batch, V]


def pick(logits: torch.Tensor, rule: int, sampling: Sampling | None,
         generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """(token, q row or None) from one row of draft logits [V]."""
    if rule == RULE_GREEDY:
        return int(kernels.greedy(logits)), None
    q = kernels.target_probs(logits.float(), **transform_of(sampling)).to(torch.float32).contiguous()   # [V]
    return sample_from(q, generator), q


def sample_from(q: torch.Tensor, generator: torch.Generator) -> int:
    """One token from q [V] by `kernels.sample`, with the next uniform of `generator`
    (float64, computed over the fp32 values exactly as published)."""
    return int(kernels.sample(q, torch.rand((), dtype=torch.float64, generator=generator)))
