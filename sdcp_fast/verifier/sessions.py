"""One record per served session, in one table the service and the engine share.

A `ServedSession` holds everything the verifier keeps for a session: the core state machine
(`machine`, the only code that changes protocol state), the session's position in its commit
log, the last refused request (for identical retries waiting on it), its self-decoding
task, when it was last touched, and the event that wakes output readers and waiting
retries. Retiring a session is dropping its record (`ServedSessions.drop`); nothing else
holds per-session state. Opens of one session id are serialised by `open_locks` (a record
may not exist yet when the first open arrives).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..aio import KeyedLock
from ..core.messages import CommitRecord, LogprobsAsk, Output, Verdict
from ..core.problems import Kind, Problem, ProblemError, problem
from ..core.session import Job, State, VerifierSession
from .logprobs import Committed, Entry
from .speculation import SessionSpeculation

_PROPOSING = frozenset({State.SERVING, State.SELF_DECODING})


@dataclass(eq=False)
class ServedSession:
    machine: VerifierSession
    log_position: int                                   # records in the session's commit log
    touched: float = 0.0                                # loop time of the last request or commit
    reserved: int = 0                                   # bytes of the memory budget it holds
    refusal: tuple[tuple | None, Problem] | None = None  # (request key, problem) last refused
    self_task: asyncio.Task | None = None               # the self-decoding loop, while it runs
    retired: bool = False
    answered_at: float = 0.0                            # perf_counter when its last job's answer went out
    turnaround_s: float = 0.0                           # from an answer to its next job (EWMA; 0: unknown)
    speculation: SessionSpeculation = field(default_factory=SessionSpeculation)   # speculation.py
    logprobs: LogprobsAsk | None = None                 # the session asked for the target's log-probabilities
    scored: tuple[int, list[Entry]] | None = None       # (round, entries) of the last scored job (logprobs.py)
    committed_logprobs: Committed | None = None         # those of its committed tokens
    _changed: asyncio.Event | None = None              # made when someone waits (most rounds: nobody)

    @property
    def id(self) -> bytes:
        return self.machine.id

    def touch(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Mark it used now, on `loop`'s clock (the running loop's when not given)."""
        self.touched = (loop or asyncio.get_running_loop()).time()

    def wake(self) -> None:
        """Wake everyone waiting for this session to change (output readers, retries)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None   # the next waiter makes a new one

    async def changed(self, timeout: float) -> None:
        """Return when the session changes, or after `timeout` seconds."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def ask_logprobs(self, ask: LogprobsAsk | None) -> None:
        """Keep the log-probabilities of the tokens committed from now on (output indices
        from the current committed length: a resumed session has none before it)."""
        self.logprobs = ask
        if ask is not None:
            self.committed_logprobs = Committed(ask.top, self.machine.committed)

    def keep_logprobs(self, record: CommitRecord) -> None:
        """A round is on the commit log: its scored log-probabilities (logprobs.py) become
        those of its emitted tokens, at their output indices. Called before its output is
        released, with no await in between."""
        kept, scored, self.scored = self.committed_logprobs, self.scored, None
        if kept is None:
            return
        first = record.committed - len(record.emitted)
        if scored is None or scored[0] != record.round or first != kept.end:
            # not scored (or out of step): later tokens would sit at the wrong indices, so
            # this session's log-probabilities end here
            self.committed_logprobs = None
            return
        kept.extend(scored[1][:len(record.emitted)])

    def with_logprobs(self, out: Output) -> Output:
        """`out` with the log-probabilities of its tokens; when the first tokens have none (a
        session resumed here), those tokens alone, without, so that the next read (from the
        first token that has them) gets them."""
        kept = self.committed_logprobs
        if kept is None or not out.tokens:
            return out
        stop = out.start + len(out.tokens)
        if out.start >= kept.base:
            if stop > kept.end:   # not expected: every committed token is kept
                return out
            return dataclasses.replace(out, logprobs=kept.slice(out.start, stop))
        if stop <= kept.base:
            return out
        return dataclasses.replace(out, tokens=out.tokens[:kept.base - out.start], final=False, finish=None)

    def refused(self, job: Job, prob: Problem) -> None:
        """Remember why a request was refused, for identical retries waiting on it."""
        self.refusal = (job.request_key, prob)
        self.wake()

    def cancel_self_decoding(self) -> None:
        task, self.self_task = self.self_task, None
        if task is not None:
            task.cancel()

    async def wait_for_verdict(self, round: int, key: tuple, timeout: float) -> Verdict:
        """An identical retry of the round in flight: its verdict, or the problem that
        refused it, or 503 when the round was not committed after all."""
        session = self.machine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            verdict = session.verdicts.get(round)
            if verdict is not None:
                return verdict
            if session.inflight is None or session.inflight.round != round or self.retired:
                break   # refused, fenced or retired: the retry gets the current answer
            await self.changed(min(0.5, max(0.0, deadline - loop.time())))
        verdict = session.verdicts.get(round)
        if verdict is not None:
            return verdict
        if self.refusal is not None and self.refusal[0] == key:
            raise ProblemError(self.refusal[1])
        if session.state == State.FENCED:
            raise problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch")
        raise problem(Kind.UNAVAILABLE, f"round {round} was not committed; retry")


class ServedSessions:
    """The verifier's session table, bounded by count (the service's max_sessions) and by
    memory: each record holds `reserved` bytes of the budget (its model state at its
    longest, and the verifier's own state), released when it is dropped. Ids of sessions
    retired while they could still go on are remembered (boundedly), so that a request for
    one gets `session-retired` (resume it from its commit log) rather than a bare 404."""

    RETIRED_REMEMBERED = 16384

    def __init__(self) -> None:
        self._records: dict[bytes, ServedSession] = {}
        self._retired: OrderedDict[bytes, None] = OrderedDict()
        self.reserved_bytes = 0
        self.open_locks = KeyedLock()   # opens of one id never interleave

    def get(self, sid: bytes) -> ServedSession | None:
        return self._records.get(sid)

    def __getitem__(self, sid: bytes) -> ServedSession:
        return self._records[sid]

    def __contains__(self, sid: object) -> bool:
        return sid in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ServedSession]:
        return iter(list(self._records.values()))

    def put(self, record: ServedSession) -> ServedSession | None:
        """Serve `record`, replacing (and retiring) the session's previous record if any."""
        old = self._records.get(record.id)
        if old is not None and old is not record:
            self.reserved_bytes -= old.reserved
            self._retire(old)
        self._records[record.id] = record
        self.reserved_bytes += record.reserved
        self._retired.pop(record.id, None)
        return old

    def drop(self, record: ServedSession, *, resumable: bool = False) -> bool:
        """Retire `record` if it is still the one served; True when it was. `resumable`: it
        was let go while it could still go on (idle, or for room): remember its id."""
        if self._records.get(record.id) is not record:
            return False
        del self._records[record.id]
        self.reserved_bytes -= record.reserved
        self._retire(record)
        if resumable:
            self._retired[record.id] = None
            while len(self._retired) > self.RETIRED_REMEMBERED:
                self._retired.popitem(last=False)
        return True

    def was_retired(self, sid: bytes) -> bool:
        return sid in self._retired

    def idle_first(self, now: float, min_idle_s: float) -> list[ServedSession]:
        """Sessions that may be retired for room, least recently used first: untouched for
        `min_idle_s`, no round in flight, not self-decoding."""
        idle = [r for r in self._records.values()
                if now - r.touched >= min_idle_s and r.machine.inflight is None and r.self_task is None]
        return sorted(idle, key=lambda r: r.touched)

    def could_propose(self) -> int:
        """Sessions that could add a job now (a drafter proposing, or the verifier
        self-decoding): the engine stops waiting for company once this many are queued."""
        # a list, not a generator: no Python call per session (this runs twice per batch)
        return sum([r.machine.state in _PROPOSING for r in self._records.values()])

    def in_play(self) -> int:
        """Sessions open and not closed: those a round of every session's drafting and
        verifying involves (speculation.py plans for them all)."""
        return sum([not r.machine.closed for r in self._records.values()])

    @staticmethod
    def _retire(record: ServedSession) -> None:
        record.retired = True
        record.cancel_self_decoding()
        record.wake()
