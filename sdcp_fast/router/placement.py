"""Placing a session (section 6.1): a verifier by load for its session-open, then a drafter.

Assigning a drafter takes two calls, in this order: PUT sessions/{id}/drafter at the
verifier first (its session-state answer is the authoritative round, committed length and
digest), then POST assignments to the drafter with the committed tokens put in the cache.
A drafter that refuses is skipped for the next candidate by load; a verifier that refuses
ends the attempt (closed, fenced, or failing: the monitor decides what next). Callers hold
the session's lock.

A session-open is given up, and the next verifier tried, as soon as the registry takes the
verifier it went to for dead (its status expired meanwhile): a verifier cut off just after
it was picked would otherwise hold the session for the open's whole timeout and retries,
far longer than the status TTL that already says it is gone.

Every message that instructs a peer is preceded by `own.act(s)` (the session's record
written under the checks that it is still this router's; router/ownership.py) or, between
two messages of one step, by `own.check(s)` (the lease's local deadline), and carries the
router epoch of the record, so a peer that has heard from a newer owner refuses it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

from ..core.digest import prefix_digest
from ..core.messages import Action, Assignment, Resume, SessionOpen
from .committed import CommittedLog
from .peers import Peers, Refused
from .registry import Registry
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router")
ATTEMPTS = 4    # drafters tried per assignment
SILENCE_POLL_S = 0.25   # how often an open under way checks that its verifier still reports


class Offer(enum.Enum):
    ASSIGNED = "assigned"
    DRAFTER_REFUSED = "drafter-refused"     # try the next drafter
    VERIFIER_REFUSED = "verifier-refused"   # stop: the verifier will not serve this drafter


class Placement:
    def __init__(self, registry: Registry, peers: Peers, committed: CommittedLog, own, *, m_init: int,
                 on_verifier_lost):
        self.registry = registry
        self.peers = peers
        self.committed = committed
        self.own = own                             # ownership.Ownership: act before acting
        self.m_init = m_init
        self.on_verifier_lost = on_verifier_lost   # (session, verifier, epoch, where): see failover.py

    async def open(self, s: RouterSession, exclude: set[str], resume: Resume | None = None) -> bool:
        """session-open at verifiers by load until one accepts it; True once one did."""
        while True:
            inst = self.registry.pick_verifier(exclude)
            if inst is None:
                return False
            msg = SessionOpen(s.id, s.epoch, s.contract, s.prompt, s.commit_log, resume=resume,
                              router_epoch=s.router_epoch or None, logprobs=s.logprobs_ask,
                              prefill_share=s.door.get("n") if resume is None and s.door.get("n", 1) > 1 else None)
            await self.own.act(s)
            state = await self._open_while_reporting(inst.uri, msg)
            if not isinstance(state, Refused):
                s.verifier = inst.uri
                s.self_decoding = state.state == int(Action.SELF_DECODE)
                s.place("opened" if resume is None else "resumed", state_round=state.round)
                s.notify()
                await self.own.act(s)
                log.info("session %s opened on %s (epoch %d, round %d)", s.id.hex(), s.verifier,
                         s.epoch, state.round)
                return True
            log.warning("session %s: %s refused session-open: %s", s.id.hex(), inst.uri, state)
            exclude = {*exclude, inst.uri}

    async def _open_while_reporting(self, verifier: str, msg: SessionOpen):
        """peers.open_session, or Refused once the verifier is taken for dead meanwhile."""
        opening = asyncio.ensure_future(self.peers.open_session(verifier, msg))
        try:
            while True:
                done, _ = await asyncio.wait({opening}, timeout=SILENCE_POLL_S)
                if done:
                    return opening.result()
                if self.registry.silent(verifier):
                    return Refused(None, "its status expired while the open was under way")
        finally:
            opening.cancel()   # a no-op once done

    async def assign(self, s: RouterSession, exclude: set[str] | frozenset[str] = frozenset(), *,
                     attempts: int = ATTEMPTS, prefer: str | None = None) -> bool:
        """A drafter by load (none of `exclude`), named to the verifier, then assigned.
        `prefer` (a router taking the session over: the drafter it had) is offered first
        unless known to be dead: a drafter already drafting the session carries on."""
        exclude = set(exclude)
        for _ in range(attempts):
            if prefer is not None and prefer not in exclude and not self.registry.silent(prefer):
                uri, prefer = prefer, None
            else:
                inst = self.registry.pick_drafter(s.contract.drafters, exclude)
                if inst is None:
                    return False
                uri = inst.uri
            offer = await self._offer(s, uri, tell_verifier=True)
            if offer is not Offer.DRAFTER_REFUSED:
                return offer is Offer.ASSIGNED
            exclude.add(uri)
        return False

    async def resend(self, s: RouterSession) -> bool:
        """The same assignment again to the session's drafter, which the verifier already
        knows (a policy update: the drafter takes the new profile); should it refuse, any
        other drafter is placed the full way."""
        drafter = s.drafter
        if drafter is None:
            return await self.assign(s)
        offer = await self._offer(s, drafter, tell_verifier=False)
        if offer is not Offer.DRAFTER_REFUSED:
            return offer is Offer.ASSIGNED
        return await self.assign(s, {drafter}, attempts=ATTEMPTS - 1)

    async def _offer(self, s: RouterSession, drafter: str, *, tell_verifier: bool) -> Offer:
        tokens, records = await self.committed.read(s)
        last = records[-1] if records else None
        assignment = Assignment(
            s.id, s.epoch, s.contract, s.verifier, drafter, s.prompt,
            last.round if last else 0, len(tokens),
            last.digest if last else prefix_digest(s.contract.digest, s.prompt), self.m_init,
            sampling=s.sampling, router_epoch=s.router_epoch or None)
        await self.own.act(s)
        if tell_verifier:
            verifier = s.verifier
            state = await self.peers.put_drafter(verifier, assignment)
            if isinstance(state, Refused):
                log.warning("session %s: verifier refused the drafter (%s)", s.id.hex(), state)
                if state.lost:
                    self.on_verifier_lost(s, verifier, assignment.epoch, "drafter")
                return Offer.VERIFIER_REFUSED
            tokens, records = await self.committed.tokens_at(s, state.committed, tokens, records)
            assignment = assignment.replace(round=state.round, committed=state.committed, digest=state.digest)
        if assignment.committed:
            assignment = assignment.replace(committed_tokens=await self.committed.publish(s, tokens))
        self.own.check(s)
        answer = await self.peers.assign(drafter, assignment)
        if isinstance(answer, Refused):
            log.warning("session %s: drafter %s refused the assignment (%s)", s.id.hex(), drafter, answer)
            return Offer.DRAFTER_REFUSED
        changed = s.drafter != drafter
        s.drafter = drafter
        s.last_progress = time.monotonic()
        if changed or tell_verifier:
            s.place("assigned", round=assignment.round)
        await self.own.act(s)
        log.info("session %s: drafter %s (epoch %d, round %d, committed %d)", s.id.hex(), drafter,
                 s.epoch, assignment.round, assignment.committed)
        return Offer.ASSIGNED
