"""Output relay (section 6.7): one long-poll reader per session, GET output?from=n with
n = tokens received so far, so a retried or repeated read never duplicates or loses a
token; output carrying a lower epoch than the session's is discarded. When the placement
changes (failover) the reader asks the new verifier at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..core.messages import Action
from .peers import Peers, Refused
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router")
RETRY_S = 0.25


class OutputRelay:
    def __init__(self, peers: Peers, *, timeout_s: float, on_verifier_lost, on_unasked_fail=None,
                 on_output=None, on_end=None):
        self.peers = peers
        self.timeout_s = timeout_s                 # bound of one long poll
        self.on_verifier_lost = on_verifier_lost   # (session, verifier, epoch, where): see failover.py
        # (session, verifier, epoch) -> True when a final "fail" is not the end: the contract
        # did not ask for fail, and the router places the session again
        self.on_unasked_fail = on_unasked_fail or (lambda s, verifier, epoch: False)
        self.on_output = on_output or (lambda s, tokens: None)   # new tokens arrived
        self.on_end = on_end or (lambda s: None)                 # the final output arrived

    async def read(self, s: RouterSession) -> None:
        """Take the session's output until its final output."""
        while not s.done:
            verifier, epoch, changed = s.verifier, s.epoch, s.changed_event()
            if verifier is None:         # not open anywhere yet (a session taken over)
                await s.wait_changed(RETRY_S)
                continue
            fetch = asyncio.ensure_future(self.peers.output(verifier, s.id, len(s.tokens), timeout=self.timeout_s))
            woken = asyncio.ensure_future(changed.wait())
            done, _ = await asyncio.wait({fetch, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if fetch not in done:       # placement changed (failover): ask the new verifier
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fetch
                continue
            out = fetch.result()
            if s.cancelled is not None:   # cancelled meanwhile: nothing more is taken
                return
            if isinstance(out, Refused):
                if out.lost:
                    self.on_verifier_lost(s, verifier, epoch, "output")
                await s.wait_changed(RETRY_S)
                continue
            n = len(s.tokens)
            if out.epoch < s.epoch or out.session != s.id or out.start > n:
                # an older epoch's verifier (discarded), or nothing we can use: ask again
                # after the placement changes or a short wait, not at once
                await s.wait_changed(RETRY_S)
                continue
            new = list(out.tokens[n - out.start:])
            if new:
                self.on_output(s, new)
                s.add_output(new, None if out.logprobs is None else out.logprobs.entries()[n - out.start:])
            if out.final and out.finish != Action.FINISH and self.on_unasked_fail(s, verifier, epoch):
                await s.wait_changed(RETRY_S)       # until the session is placed again
                continue
            if out.final:
                s.end(finish=out.finish if out.finish in (Action.FINISH, Action.FAIL) else Action.FAIL)
                s.place(f"final-{s.finish.name.lower()}")
                s.notify()
                self.on_end(s)
                log.info("session %s: %s with %d tokens", s.id.hex(), s.finish.name.lower(), len(s.tokens))
