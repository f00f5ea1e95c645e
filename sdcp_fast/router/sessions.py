"""What the router keeps per session: placement (epoch, verifier, drafter), the output the
front door has received, and the bookkeeping its monitor needs.

A session is owned here (`owned` is the session-table record this router holds: it places
and relays it) or followed (`owned` is None: another router owns it, and this router only
streams it to a client that reconnected here, from the commit log; follow.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..core.messages import Action, Contract, LogprobsAsk, Sampling

RECHECK_S = 15.0      # a client's stream looks at its session again at least this often, changed or not
HISTORY_KEPT = 64     # placements remembered per session (a long session stalls and fails over
                      # without bound; its record and its clients see the latest ones)


@dataclass(eq=False)
class RouterSession:
    id: bytes
    contract: Contract
    prompt: tuple[int, ...]
    commit_log: str                           # cache-ref of the session's commit log
    epoch: int = 1
    allocated: int = 1                        # highest epoch allocated for a fence (stored.py)
    router_epoch: int = 0                     # ownership epoch: the record's fencing token
    owned: object | None = None               # cache.Owned: the session-table record held here
    door: dict = field(default_factory=dict)  # the client-facing stream (which API, its options)
    verifier: str | None = None
    drafter: str | None = None
    sampling: Sampling | None = None          # profile set by a policy update, if any
    policy_from_round: int | None = None
    tokens: list[int] = field(default_factory=list)   # output o[1..n] received, in order
    logprobs: list | None = None              # the target's (log p, [(id, log p)]) per token of
                                              # `tokens` when the door asked (None: a token the
                                              # verifier had none for, e.g. before a failover)
    finish: Action | None = None              # FINISH or FAIL once the final output arrived
    cancelled: str | None = None              # ended by the router: "abort" (the client went
                                              # away) or "stop" (a stop string was met)
    final_tokens: int | None = None           # output length at the end (a cancelled session's
                                              # log may hold a round more)
    replace_why: str | None = None            # why the next failover runs (metrics)
    needs_drafter: bool = False               # no drafter could be assigned yet: retry
    self_decoding: bool = False               # its verifier decodes it alone since the open: a drafter
                                              # is assigned when that ends (the verifier's event)
    verifier_lost: bool = False               # the verifier said sdcp-stale-epoch: resume
    resume_pending: bool = False              # log fenced at `epoch`, session not open anywhere yet
    history: list[dict] = field(default_factory=list)  # the last placements, for clients and tests
    seen_events: set[tuple] = field(default_factory=set)  # (epoch, kind, committed) handled
    created: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)
    finished_wall: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    last_progress: float = field(default_factory=time.monotonic)
    last_output_at: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one control step at a time
    _changed: asyncio.Event | None = None     # made when someone waits: an Event holds a deque
                                              # (~0.7 KB), and most ended sessions kept for
                                              # re-reads are never waited on again

    @property
    def done(self) -> bool:
        return self.finish is not None or self.cancelled is not None

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's words: stop (a stop token or string), length (max_new), abort, fail."""
        if self.cancelled is not None:
            return self.cancelled
        if self.finish is None:
            return None
        if self.finish != Action.FINISH:
            return "fail"
        if self.tokens and self.tokens[-1] in self.contract.stop:
            return "stop"
        return "length" if len(self.tokens) >= self.contract.max_new else "stop"

    def notify(self) -> None:
        """Wake everyone waiting for new output or a new placement."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self, timeout: float, event: asyncio.Event | None = None) -> None:
        """Until the next `notify` (or `event`, one `changed_event` gave before the caller
        looked at the session) or `timeout` s. Under asyncio.timeout, not wait_for: on
        Python 3.11 wait_for drops a cancellation that arrives as the event is set, and the
        waiter (a reader being replaced, a client's request) would go on as if not cancelled."""
        event = event or self.changed_event()
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass

    def changed_event(self) -> asyncio.Event:
        """The event the next `notify` sets (take it before looking at the session's state)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def place(self, what: str, **details) -> None:
        self.history.append({"t": round(time.time(), 4), "what": what, "epoch": self.epoch,
                             "verifier": self.verifier, "drafter": self.drafter,
                             "committed": len(self.tokens), **details})
        if len(self.history) > HISTORY_KEPT:
            del self.history[:-HISTORY_KEPT]

    @property
    def logprobs_ask(self) -> LogprobsAsk | None:
        """What the session-open asks of the verifier (the door's `logprobs` member: the
        alternatives per token and whether processed scores), or None."""
        ask = self.door.get("logprobs")
        return None if ask is None else LogprobsAsk(ask.get("top", 0), ask.get("processed") or None)

    def add_output(self, tokens: list[int], logprobs: list | None = None) -> None:
        """Append received tokens (and, aligned with them, their log-probabilities, if the
        door asked; None where the output message carried none)."""
        if self.final_tokens is not None:
            tokens = tokens[:max(0, self.final_tokens - len(self.tokens))]
        if tokens:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            if self.door.get("logprobs") is not None:
                if self.logprobs is None:
                    self.logprobs = [None] * len(self.tokens)
                self.logprobs.extend((logprobs or [None] * len(tokens))[:len(tokens)])
            self.tokens.extend(tokens)
            self.last_progress = now
            self.notify()

    def end(self, *, finish: Action | None = None, cancelled: str | None = None) -> None:
        """The session has ended (the final output arrived, or the router cancelled it)."""
        self.finish, self.cancelled = finish, cancelled
        self.final_tokens = len(self.tokens)
        self.finished_at = time.monotonic()
        self.finished_wall = time.time()

    def info(self) -> dict:
        return {
            "id": self.id.hex(), "epoch": self.epoch, "router_epoch": self.router_epoch,
            "owned": self.owned is not None, "verifier": self.verifier,
            "drafter": self.drafter, "committed": len(self.tokens), "tokens": list(self.tokens),
            "finish": None if self.finish is None else self.finish.name.lower(),
            "finish_reason": self.finish_reason,
            "history": list(self.history),
            "seconds": None if self.finished_at is None else round(self.finished_at - self.created, 4),
        }


def expired(sessions: dict[bytes, RouterSession], now: float, keep_s: float, keep_max: int) -> list[RouterSession]:
    """The ended sessions of `sessions` a router lets go of now (monotonic `now`): those that
    ended over `keep_s` ago, and the oldest beyond `keep_max`, so that what it keeps for
    re-reads is bounded by count whatever the rate of generations, not only by time. The
    router deletes a session's record with it: a re-read is answered 404 from then on, as
    one after `keep_s`. Nothing else needs an ended session: its output is in its commit log,
    and its verifier and drafter let it go on their own."""
    ended = [s for s in sessions.values() if s.done and s.finished_at is not None]
    over = max(0, len(ended) - keep_max)
    if over:
        ended.sort(key=lambda s: s.finished_at)
    return ended[:over] + [s for s in ended[over:] if now - s.finished_at > keep_s]
