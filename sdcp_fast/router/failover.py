"""Section 6.9, verifier failure: fence the commit log with a new epoch, read its last
effective record, put the committed tokens in the cache, open the session with `resume` at
another verifier (the old one when no other takes it), re-send the sampling policy, assign
a drafter.

A verifier fails over when its status expired, or when it answered sdcp-stale-epoch or
session-retired to a request of the current placement (PUT drafter, policy, output): it lost
the session (fenced, or let go to make room; its commit log stays). The
fence and the open are two steps: a fence whose open failed is kept (`resume_pending`) and
the next attempt only opens, even if the old verifier reports status again (it can no
longer commit).

The new epoch is allocated in the session's record before the fence (`allocated`, above
every epoch any owner of the session allocated), so two routers never fence with the same
epoch: a router that lost the session cannot allocate one, and the one taking it over
allocates above what the record shows (docs/ARCHITECTURE.md, "Routers: ownership").
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..cache import Fenced
from ..core.messages import ROLE_VERIFIER, Policy, Resume
from ..refs import target_kv_ref
from .committed import CommittedLog
from .peers import Peers
from .placement import Placement
from .registry import Registry
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router")


class Failover:
    def __init__(self, registry: Registry, peers: Peers, committed: CommittedLog, commit_log,
                 placement: Placement, own, *, target_kv: bool):
        self.own = own                # ownership.Ownership: act before acting
        self.registry = registry
        self.peers = peers
        self.committed = committed
        self.commit_log = commit_log
        self.placement = placement
        self.target_kv = target_kv    # offer the verifier's published target KV on resume

    def verifier_lost(self, s: RouterSession, verifier: str | None, epoch: int, where: str) -> None:
        """The verifier answered sdcp-stale-epoch or session-retired to a request of the
        current placement: it no longer serves the session (its log was fenced, it stopped,
        or it retired the session for room). The monitor then resumes the session, at that
        verifier too if no other takes it."""
        if (verifier, epoch) == (s.verifier, s.epoch) and not s.resume_pending:
            log.warning("session %s: %s answered stale-epoch to %s; resuming", s.id.hex(), verifier, where)
            s.verifier_lost = True

    def needed(self, s: RouterSession) -> bool:
        """Fence and resume elsewhere: the verifier's status expired, it said it lost the
        session, or an earlier failover fenced the log but could not open it anywhere yet."""
        return s.resume_pending or s.verifier_lost or self.registry.silent(s.verifier)

    def _why(self, s: RouterSession) -> str:
        if s.verifier_lost:
            return s.replace_why or "it no longer holds the session"
        inst = self.registry.get(s.verifier)
        if inst is None or inst.status is None:
            return "it never reported its status"
        return f"its status expired {time.monotonic() - inst.expires:.2f} s ago"

    async def run(self, s: RouterSession) -> None:
        async with s.lock:
            old = s.verifier
            if s.done or not self.needed(s):
                return
            if not self.registry.live(ROLE_VERIFIER):
                return     # nowhere to go yet; the monitor tries again
            if not s.resume_pending:
                log.warning("session %s: failing over from %s: %s", s.id.hex(), old, self._why(s))
                epoch = max(s.epoch, s.allocated) + 1
                s.allocated = epoch
                await self.own.act(s)    # the epoch is this owner's before anything is fenced with it
                try:
                    await self.commit_log.fence(s.commit_log, epoch)
                except Fenced as exc:
                    log.error("session %s: log already fenced above epoch %d (%s)", s.id.hex(), epoch, exc)
                    return
                s.epoch = epoch          # from here on, output of older epochs is discarded
                s.resume_pending, s.verifier_lost = True, False
                s.notify()
                await self.own.act(s)
            tokens, records = await self.committed.read(s)
            resume = None
            if records:
                last = records[-1]
                ref = await self.committed.publish(s, tokens)
                kv = target_kv_ref(s.id, s.contract.scope) if self.target_kv else None
                resume = Resume(last.round, last.committed, last.digest, ref, target_kv=kv)
            log.warning("session %s: verifier %s lost; epoch %d fenced, resuming at %d tokens",
                        s.id.hex(), old, s.epoch, len(tokens))
            # another verifier first; the old one (live again, or one that only lost the
            # session) when no other takes it
            others = {i.uri for i in self.registry.live(ROLE_VERIFIER)} - {old}
            if not await self.placement.open(s, exclude={old}, resume=resume) and \
                    not await self.placement.open(s, exclude=others, resume=resume):
                await asyncio.sleep(0.5)    # every live verifier refused: retry, not at once
                return
            s.resume_pending = False
            s.place("failover", old_verifier=old, resumed_at=len(tokens))
            await self.own.act(s)
            if s.sampling is not None and s.policy_from_round is not None:
                from_round = max(s.policy_from_round, (records[-1].round if records else 0) + 1)
                await self.peers.set_policy(s.verifier, Policy(s.id, from_round, s.sampling,
                                                               router_epoch=s.router_epoch or None))
            if not s.self_decoding and not await self.placement.assign(s):
                s.needs_drafter = True
