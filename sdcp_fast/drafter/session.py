"""One assigned session on the drafter: the round loop of section 6.2.

    assignment -> prepare KV for the committed prefix -> loop:
        M = choose_m(alpha, t_draft, t_verify(M), min(m_max, m_cap))   # t_verify learned per M
        draft M tokens (batched with other sessions), q rows (rule 2) and draft KV to the
        cache under leases -> POST proposal (one outstanding per session) -> while it is
        out, draft ahead as if all M were accepted -> verdict:
            check it extends our prefix, release the leases, commit the emitted tokens to
            the draft KV, update alpha and m_cap, reuse the look-ahead if the verifier's
            additional token is the one we guessed; stop on switch, self_decode, finish, fail.

A verdict lost in transit is retried with the same bytes (proposals are idempotent per
round, section 6.9), with backoff; with no verdict for `give_up_after_s`, or after
`max_q_republish` sdcp-q-unavailable answers to one proposal, the session stops here and
the router places it again. However the loop ends, the leases of the proposal it held are
released. A 409 stale-base resynchronises from the problem's session-state
when the drafter knows the tokens involved; otherwise the session stops and the router
reassigns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from ..cache import NotFound
from ..core.control import AcceptanceEstimate, VerifyCost, choose_m, clamp_m_init
from ..core.digest import chain, extend_digest, prefix_digest
from ..core.messages import (
    RULE_SPECULATIVE,
    Action,
    Assignment,
    Proposal,
    SessionState,
    Verdict,
)
from ..core.problems import Kind
from ..models.base import ModelError
from ..refs import draft_kv_ref, q_rows_ref
from ..transport import TransportError, call
from .drafting import DraftRequest

log = logging.getLogger("sdcp_fast.drafter")

STOP_ACTIONS = frozenset({Action.SWITCH, Action.SELF_DECODE, Action.FINISH, Action.FAIL})
LOOKAHEAD_MIN_P = 0.5       # draft ahead only when it is used at least as often as thrown away
Q_RETRY_LEASE_MS = 30_000   # lease of q rows published again after sdcp-q-unavailable


# a verify-cost point of an M not proposed for as many rounds as the EWMA of the M being
# proposed takes to replace 97% of its past leaves the line (control.VerifyCost.forget_after)
STALE_ROUNDS = math.ceil(math.log(0.03) / math.log(1 - VerifyCost.weight))


@dataclass
class Timing:
    """The two costs in the M-choice rule (seconds, docs/ARCHITECTURE.md "Choosing M"): an
    EWMA of drafting one token, and the verify cost as a function of M learned from
    verdict timing (proposal sent -> verdict received, per M proposed), whose points of an M
    no longer proposed are forgotten after STALE_ROUNDS rounds."""

    draft_per_token: float = 0.002   # drafting one token, including its cache writes
    verify_cost: VerifyCost = field(default_factory=lambda: VerifyCost(forget_after=STALE_ROUNDS))
    weight: float = 0.3
    last_m: int = 1

    def observe_draft(self, seconds: float, m: int) -> None:
        self.draft_per_token += self.weight * (seconds / max(1, m) - self.draft_per_token)

    def observe_verify(self, seconds: float, m: int) -> None:
        self.verify_cost.observe(m, seconds)
        self.last_m = m

    @property
    def verify(self) -> float:
        """The verify cost at the last M proposed (round records, logs)."""
        return self.verify_cost.at(self.last_m)


@dataclass
class LookaheadOdds:
    """How often a look-ahead would be used, measured on this session's own rounds: an EWMA
    of rounds that accepted all M (over every round, look-ahead or not), and one of the
    verifier's additional token equal to our guess (over the fully accepted rounds that had a
    guess). Measured rather than derived from alpha: acceptance comes in runs (easy stretches
    accept everything), so alpha^M, which treats positions as independent, falls well short
    of the rate at which rounds really are fully accepted."""

    full: float = 0.5
    guess: float = 1.0        # until a guess was checked: the full-acceptance rate alone decides
    weight: float = 0.2

    def observe(self, accepted: int, m: int, guess_right: bool | None) -> None:
        self.full += self.weight * (float(accepted == m) - self.full)
        if guess_right is not None:
            self.guess += self.weight * (float(guess_right) - self.guess)

    @property
    def hit(self) -> float:
        """The chance that a look-ahead drafted now is used by the next proposal."""
        return self.full * self.guess


@dataclass
class Built:
    """A proposal ready to send (or re-send: deterministic CBOR, the same bytes every retry)."""

    proposal: Proposal
    rows: torch.Tensor | None       # [M, V] fp32 q rows (rule 2)
    leased: list[str]               # cache objects held until the verdict
    draft_seconds: float
    retries: int = 0                # times the same bytes were sent again
    ahead: int = 0                  # tokens taken from the look-ahead drafted during the last round
    built_at: float = 0.0           # wall clock (time.time()) when building began,
    sent_at: float = 0.0            # ... when first sent,
    answered_at: float = 0.0        # ... when its verdict arrived (the rounds log's timeline)
    drafted_ahead: int = 0          # tokens drafted ahead while it was out (used or not)
    settle_seconds: float = 0.0     # waiting, at its verdict, for the look-ahead's step under way
    guess_right: bool | None = None # the verifier's additional token was the look-ahead's first


class Backoff:
    """Exponential waits between retries of one proposal: 50 ms doubling up to 1 s."""

    def __init__(self, first: float = 0.05, most: float = 1.0):
        self.next, self.most = first, most

    async def wait(self) -> None:
        await asyncio.sleep(self.next)
        self.next = min(self.most, self.next * 2)


class Stop(Exception):
    """The session ends on this drafter (reason in the message); `final` when it has ended
    for good (finish or fail), not merely moved elsewhere."""

    def __init__(self, reason: str, *, final: bool = False):
        super().__init__(reason)
        self.final = final


class DraftSession:
    def __init__(self, service, assignment: Assignment, prompt: tuple[int, ...],
                 output: list[int]):
        self.service = service
        self.id = assignment.session
        self.apply(assignment, prompt, output)
        self.alpha = AcceptanceEstimate()
        self.odds = LookaheadOdds()
        self.timing = Timing()
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big"))
        self.seq = 0                      # proposals built, for unique cache names
        self.task: asyncio.Task | None = None
        self.stopped: str | None = None
        self.lookahead: DraftRequest | None = None
        self.lookahead_task: asyncio.Task | None = None
        self.round_ahead: bool | None = None   # whether the round out now may draft ahead (ahead.py)
        self.last_ahead: bool | None = None    # ... and the round before it
        self.last_answer: float | None = None  # perf_counter at the last verdict
        self.reserved = 0                 # bytes of the drafter's memory budget it holds

    # ------------------------------------------------------------------ state

    def apply(self, a: Assignment, prompt: tuple[int, ...], output: list[int]) -> None:
        self.epoch = a.epoch
        self.placed_by = (a.epoch, a.router_epoch or 0)   # (epoch, router epoch) of the placement
        self.contract = a.contract
        self.verifier = a.verifier.rstrip("/")
        self.prompt = prompt
        self.output = list(output)           # committed output o[1..n]
        self.round = a.round
        self.committed = a.committed
        self.digest = a.digest
        self.sampling = a.sampling or a.contract.sampling
        self.m_cap = clamp_m_init(a.m_init, a.contract.m_max)

    @property
    def rule(self) -> int:
        return self.contract.rule

    @property
    def sequence(self) -> list[int]:
        return [*self.prompt, *self.output]

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    # ------------------------------------------------------------------ KV preparation

    async def prepare_kv(self) -> None:
        """Make the draft backend's committed sequence equal prompt + output: keep what we
        hold if it is a prefix, else import the published draft KV, else prefill."""
        backend, lock = self.service.backend, self.service.batcher.model_lock
        want = self.sequence
        async with lock:
            with contextlib.suppress(ModelError):
                have = backend.committed(self.id)
                if have == want[:len(have)] and have:
                    if len(have) < len(want):
                        backend.commit(self.id, want[len(have):])
                    return
                backend.release(self.id)
        blob = None
        with contextlib.suppress(NotFound, Exception):
            blob = await self.service.store.get(draft_kv_ref(self.id, self.contract.scope))
        if blob is not None:
            async with lock:
                try:
                    backend.import_kv(self.id, blob)
                    have = backend.committed(self.id)
                    if have == want[:len(have)]:
                        if len(have) < len(want):
                            backend.commit(self.id, want[len(have):])
                        log.info("session %s: draft KV imported (%d tokens)", self.id.hex(), len(have))
                        return
                    backend.release(self.id)
                except ModelError as exc:
                    log.info("session %s: published draft KV unusable (%s)", self.id.hex(), exc)
                    with contextlib.suppress(ModelError):
                        backend.release(self.id)
        await self.service.batcher.open(self.id, want)

    # ------------------------------------------------------------------ the round loop

    async def run(self) -> None:
        built: Built | None = None          # the proposal out (or about to be): its leases
        try:
            await self.prepare_kv()
            while True:
                if self.committed >= self.contract.max_new:
                    raise Stop("max_new reached")
                if built is None:
                    built = await self.build()
                outcome = await self.exchange(built)
                if isinstance(outcome, Verdict):
                    built = await self.on_verdict(built, outcome)
                elif outcome == "rebuild":
                    self.cancel_lookahead()      # it drafted on top of the refused proposal
                    await self.release(built)
                    built = None
        except Stop as stop:
            self.stopped = str(stop)
            log.info("session %s stops on %s: %s", self.id.hex(), self.service.config.uri, stop)
            if stop.final:                     # the session can never come back: free its KV
                await self.service.release_kv(self.id)
        except asyncio.CancelledError:
            self.stopped = "cancelled"
            raise
        except Exception as exc:
            self.stopped = f"error: {exc}"
            log.exception("session %s failed on the drafter", self.id.hex())
        finally:
            self.cancel_lookahead()
            if built is not None and built.leased:
                # however the loop ended, the artifacts of the proposal it held are no longer
                # needed by anyone: release now rather than leave them to their lease
                await asyncio.shield(self.release(built))

    def choose(self) -> int:
        limit = min(self.contract.m_max, self.m_cap, self.contract.max_new - self.committed)
        return choose_m(self.alpha.alpha, self.timing.draft_per_token, self.timing.verify_cost.at,
                        max(1, limit))

    async def build(self, ready: DraftRequest | None = None) -> Built:
        """Draft M tokens (reusing `ready`'s tokens, drafted ahead, when given) and publish
        the artifacts the verifier may need."""
        m = self.choose()
        started, built_at = time.perf_counter(), time.time()
        tokens, rows = [], []
        if ready is not None:
            tokens, rows = ready.tokens[:m], ready.rows[:m]
        if len(tokens) < m:
            request = DraftRequest(self.id, list(tokens), m - len(tokens), self.rule, self.sampling,
                                   self.generator)
            await self.service.batcher.draft(request)
            tokens, rows = tokens + request.tokens, rows + request.rows
        self.seq += 1
        leased: list[str] = []
        q_ref = draft_kv = None
        rows_tensor = None
        try:
            if self.rule == RULE_SPECULATIVE:
                rows_tensor = torch.stack(rows).contiguous()            # [M, V]
                q_ref = q_rows_ref(self.id, self.epoch, self.round + 1, self.seq, self.contract.scope)
                leased.append(q_ref)      # before the put: a put cut short may have stored it
                await self.service.put_leased(q_ref, rows_tensor.numpy().tobytes())
            if self.service.config.publish_draft_kv:
                draft_kv = await self.service.publish_draft_kv(self)
        except BaseException:
            await asyncio.shield(self._release_refs(leased))
            raise
        seconds = time.perf_counter() - started
        self.service.metrics.draft_seconds.observe(seconds)
        proposal = Proposal(self.id, self.epoch, self.round + 1, self.service.config.uri,
                            self.committed, self.digest, tuple(tokens), self.service.status(),
                            q_rows=q_ref, draft_kv=draft_kv)
        return Built(proposal, rows_tensor, leased, seconds, ahead=len(ready.tokens[:m]) if ready else 0,
                     built_at=built_at)

    async def exchange(self, built: Built) -> Verdict | str:
        """Send the proposal until a verdict or a problem that changes what to send.
        Returns the verdict or "rebuild"; raises Stop when the session ends here, including
        when the verifier gives no verdict for `give_up_after_s` or keeps answering
        sdcp-q-unavailable (the router then places the session again)."""
        config = self.service.config
        url = self.verifier + "/proposals"
        backoff = Backoff()
        republished = 0
        failing_since: float | None = None      # first transport error / 5xx in a row
        self.start_lookahead(built)
        sent_at = time.perf_counter()
        built.sent_at = built.sent_at or time.time()
        while True:
            try:
                reply = await call(self.service.client, "POST", url, built.proposal, Verdict,
                                   timeout=config.request_timeout_s)
                failure = f"HTTP {reply.status}" if reply.status >= 500 else \
                    None if reply.ok or reply.status != 200 else reply.detail   # 200 but no verdict
            except TransportError as exc:
                # no answer: the verdict may be lost; the same bytes get the same verdict
                reply, failure = None, str(exc)
            problem = reply.problem if reply is not None else None
            kind = problem.kind if problem is not None else None
            if not (reply is not None and reply.ok):
                self.service.metrics.outcome(kind or "no_answer")
            if failure is not None or kind == Kind.UNAVAILABLE:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= config.give_up_after_s:
                    raise Stop(f"no verdict for {config.give_up_after_s:g} s: {failure or kind.suffix}")
                log.info("session %s round %d: %s; retrying", self.id.hex(), built.proposal.round,
                         failure or kind.suffix)
                built.retries += 1
                await backoff.wait()
                continue
            failing_since = None
            if reply.ok:
                verdict = reply.message
                if self.service.drop_verdict(self, verdict):
                    built.retries += 1
                    continue   # test hook: as if the response were lost in transit
                self.timing.observe_verify(time.perf_counter() - sent_at, built.proposal.m)
                built.answered_at = time.time()
                self.service.metrics.verdict(built.proposal.m, verdict.accepted)
                return verdict
            if kind == Kind.Q_UNAVAILABLE and built.rows is not None:
                republished += 1
                if republished > config.max_q_republish:
                    raise Stop(f"q rows unavailable to the verifier after {config.max_q_republish} "
                               "republications")
                # our lease lapsed or the store dropped it: publish the same rows again, with
                # a lease long enough to outlast a slow verifier
                await backoff.wait()
                await self.service.put_leased(built.proposal.q_rows, built.rows.numpy().tobytes(),
                                              max(config.lease_ms, Q_RETRY_LEASE_MS))
                built.retries += 1
                continue
            if kind == Kind.STALE_BASE and problem.state is not None:
                await self.resync(SessionState.from_obj(problem.state))
                return "rebuild"
            if kind == Kind.LIMIT:
                self.m_cap = max(1, min(self.m_cap, built.proposal.m) - 1)
                return "rebuild"
            reason = kind.suffix if kind is not None else f"HTTP {reply.status}"
            raise Stop(f"proposal refused: {reason}", final=kind == Kind.SESSION_CLOSED)

    async def on_verdict(self, built: Built, verdict: Verdict) -> Built | None:
        p = built.proposal
        if (verdict.session, verdict.epoch, verdict.round) != (p.session, p.epoch, p.round):
            raise Stop("verdict for another round")
        emitted = list(verdict.emitted)
        if verdict.committed != self.committed + len(emitted) or \
                verdict.digest != extend_digest(self.digest, emitted):
            raise Stop("verdict does not extend our prefix")
        await self.release(built)
        ours = tuple(emitted[:verdict.accepted]) == p.tokens[:verdict.accepted]
        if not ours:
            # the stored verdict of this round answered another proposal (section 6.3 replays
            # by round): it is still the committed state, so we adopt it, without look-ahead
            log.info("session %s round %d: verdict of another proposal adopted", self.id.hex(), p.round)
            self.cancel_lookahead()
        # the look-ahead drafts on top of the old committed sequence: settle it first
        ahead = await self.take_lookahead(built, verdict)
        self.timing.observe_draft(built.draft_seconds, p.m)
        self.time_round(p.m if ours else 0)
        if ours:
            self.alpha = self.alpha.update(verdict.accepted, p.m)
            self.odds.observe(verdict.accepted, p.m, built.guess_right)
        self.output.extend(emitted)
        self.committed, self.digest, self.round = verdict.committed, verdict.digest, verdict.round
        self.m_cap = max(1, verdict.m_cap)
        async with self.service.batcher.model_lock:
            self.service.backend.commit(self.id, emitted)
        self.service.record_round(self, built, verdict)
        if verdict.action in STOP_ACTIONS:
            raise Stop(f"verdict action {verdict.action.name.lower()}",
                       final=verdict.action in (Action.FINISH, Action.FAIL))
        return await self.build(ahead)

    # ------------------------------------------------------------------ drafting ahead

    def start_lookahead(self, built: Built) -> None:
        """Draft the next proposal while this one is out, assuming all M are accepted: the
        first token drafted ahead is our guess for the verifier's additional token. Only
        when it is likely to be used (`LookaheadOdds.hit` >= LOOKAHEAD_MIN_P, measured on
        this session's rounds): otherwise the work is mostly thrown away and, on cores the
        drafter shares, slows the others down; and only in the rounds the drafter's measured
        choice lets draft ahead (`AheadChooser`: whether it pays here at all)."""
        self.cancel_lookahead()
        m = built.proposal.m
        self.round_ahead = self.service.ahead.ahead if self.service.config.draft_ahead else None
        if not self.round_ahead or self.odds.hit < LOOKAHEAD_MIN_P:
            return
        room = self.contract.max_new - self.committed - m - 1
        want = min(self.contract.m_max, self.m_cap + 1, self.choose() + 1, room) + 1
        if want < 2:
            return
        request = DraftRequest(self.id, list(built.proposal.tokens), want, self.rule, self.sampling,
                               self.generator)
        self.lookahead = request
        self.lookahead_task = asyncio.get_running_loop().create_task(self.service.batcher.draft(request))

    def time_round(self, m: int) -> None:
        """A verdict answered a proposal of `m` tokens: the round, answer to answer, counts for
        the drafter's choice of drafting ahead when the round before it ran the same way."""
        now = time.perf_counter()
        way = self.round_ahead
        if way is not None and way == self.last_ahead and self.last_answer is not None:
            self.service.ahead.observe(way, now - self.last_answer, m)
        self.last_answer, self.last_ahead = now, way

    async def take_lookahead(self, built: Built, verdict: Verdict) -> DraftRequest | None:
        """The tokens drafted ahead that the verdict leaves valid (all M accepted and the
        verifier's additional token the one we guessed), without their first (the guess).
        The look-ahead stops at the verdict: tokens it has not drafted yet are drafted by
        `build`, in the batch of the step that comes next, rather than waited for here."""
        request, self.lookahead = self.lookahead, None
        if request is None:
            return None
        task, self.lookahead_task = self.lookahead_task, None
        if verdict.accepted != built.proposal.m or not verdict.emitted:
            built.drafted_ahead = len(request.tokens)
            request.cancel()
            task.cancel()
            return None
        waited = time.perf_counter()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.service.batcher.settle(request)
            await task
        built.settle_seconds = time.perf_counter() - waited
        built.drafted_ahead = len(request.tokens)
        if request.tokens:
            built.guess_right = request.tokens[0] == verdict.emitted[-1]
        if len(request.tokens) < 2 or not built.guess_right:
            return None
        self.service.lookahead_hits += 1
        return DraftRequest(self.id, [], 0, self.rule, self.sampling, self.generator,
                            tokens=request.tokens[1:], rows=request.rows[1:])

    def cancel_lookahead(self) -> None:
        if self.lookahead is not None:
            self.lookahead.cancel()
            self.lookahead = None
        if self.lookahead_task is not None:
            self.lookahead_task.cancel()
            self.lookahead_task = None

    # ------------------------------------------------------------------ resync and cleanup

    async def resync(self, state: SessionState) -> None:
        """Section 6.3's stale-base answer: adopt the verifier's round, committed length and
        digest when we can reconstruct that prefix; otherwise stop (the router reassigns)."""
        if state.epoch != self.epoch:
            raise Stop("stale epoch")
        if state.state is not None and Action.lenient(state.state) in STOP_ACTIONS:
            raise Stop(f"session is {Action.lenient(state.state).name.lower()}")
        self.cancel_lookahead()
        if state.committed == self.committed and state.digest == self.digest:
            self.round = state.round
            return
        if state.committed < self.committed:
            d0 = prefix_digest(self.contract.digest, self.prompt)
            if chain(d0, self.output[:state.committed])[-1] == state.digest:
                self.output = self.output[:state.committed]
                self.committed, self.digest, self.round = state.committed, state.digest, state.round
                async with self.service.batcher.model_lock:
                    with contextlib.suppress(ModelError):
                        self.service.backend.release(self.id)
                await self.prepare_kv()
                return
        raise Stop(f"cannot resync to {state.committed} committed tokens")

    async def release(self, built: Built) -> None:
        await self._release_refs(built.leased)

    async def _release_refs(self, refs: list[str]) -> None:
        while refs:
            ref = refs.pop()
            with contextlib.suppress(NotFound, Exception):
                await self.service.store.release(ref)


def round_record(session: DraftSession, built: Built, verdict: Verdict, retries: int,
                 fingerprint: str) -> str:
    return json.dumps({
        "t": round(time.time(), 4), "session": session.id.hex(), "epoch": verdict.epoch,
        "round": verdict.round, "m": built.proposal.m, "accepted": verdict.accepted,
        "emitted": len(verdict.emitted), "m_cap": verdict.m_cap,
        "action": verdict.action.name.lower(), "low": verdict.low, "load": verdict.load,
        "draft_ms": round(1000 * built.draft_seconds, 3),
        "verify_ms": round(1000 * session.timing.verify, 3),
        "alpha": round(session.alpha.alpha, 4), "retries": retries, "verdict": fingerprint,
        "ahead": built.ahead, "drafted_ahead": built.drafted_ahead,
        "settle_ms": round(1000 * built.settle_seconds, 3), "built_at": round(built.built_at, 4), "sent_at": round(built.sent_at, 4),
        "answered_at": round(built.answered_at, 4),
    }, separators=(",", ":"))
