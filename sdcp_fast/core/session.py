"""The verifier's per-session state machine, sans-IO (draft sections 6.1 to 6.7).

Every transition is in `TRANSITIONS`, and `_move` is the only code that changes `state`:
every method either moves the session along one row of that table or refuses with a
`ProblemError` (tests/core/test_session_table.py walks every (state, event) pair). The
caller (the verifier role) does all IO:

    session = VerifierSession.open(msg, model_digest=..., prompt=[...])
    session.assign(assignment)                                   -> SessionState
    step = session.check(caller, proposal)                       -> Replay | Wait | Job
    record = session.complete(job, accepted, extra, load[, plan]) -> CommitRecord
      (or session.refuse(job, problem) when q rows were unavailable or bad)
    verdict = session.commit_result(appended=True)               -> Verdict | None (self round)
      (or session.commit_failed() when nothing could be appended)
    job = session.next_self_job(load)                            -> Job | None
    session.output(start)                                        -> Output | None (wait)
    session.take_events()                                        -> [Event] for the router

A verification job is handed out only after every check of section 6.3 has passed, in the
draft's order: authorization, fencing, idempotency (a stored verdict is replayed; an
identical request still being verified waits for it), base and round, limits, the rule's
preconditions. The commit record is released to the caller before any verdict exists, so
no verdict or output leaves before the append; a fenced append discards the round and the
session stops being served.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .control import (
    SELF_DECODE,
    Counters,
    Escalation,
    clamp_m_init,
    escalate,
    is_low,
    next_m_cap,
    self_decode_permitted,
)
from .digest import extend_digest, prefix_digest
from .messages import (
    RULE_SPECULATIVE,
    Action,
    Assignment,
    CommitRecord,
    Contract,
    Event,
    Output,
    Policy,
    Proposal,
    Sampling,
    SessionOpen,
    SessionState,
    Verdict,
)
from .problems import Kind, Problem, ProblemError, problem
from .rng import UniformSource, round_uniforms, uniform_source

REPLAY_WINDOW = 8        # verdicts kept for retried rounds
MAX_PENDING_POLICIES = 16


class State(enum.Enum):
    # hashed by identity (members are singletons that compare by identity): Enum's own
    # __hash__ is a Python call, and every transition looks (state, event) up in a dict
    __hash__ = object.__hash__

    OPEN = "open"                      # created; no drafter assigned yet
    SERVING = "serving"                # the assigned drafter may propose
    VERIFYING = "verifying"            # one job (proposal or self-decoded token) is out
    COMMITTING = "committing"          # its commit record is being appended
    SELF_DECODING = "self-decoding"    # the verifier decodes the session itself
    AWAITING_DRAFTER = "awaiting-drafter"  # after switch or a self-decoding period
    FINISHED = "finished"
    FAILED = "failed"
    FENCED = "fenced"                  # a higher epoch fenced the log: never served again


class Ev(enum.Enum):
    __hash__ = object.__hash__   # as State's

    ASSIGN = "assign"
    PROPOSE = "propose"
    SELF_STEP = "self-step"
    RESULT = "result"
    REFUSED = "refused"                    # the job is refused; a drafter proposes next
    SELF_REFUSED = "self-refused"          # a self-decoded job is refused; self-decoding goes on
    COMMIT_CONTINUE = "commit-continue"
    COMMIT_SWITCH = "commit-switch"
    COMMIT_SELF = "commit-self"
    COMMIT_FINISH = "commit-finish"
    COMMIT_FAIL = "commit-fail"
    COMMIT_REASSIGNED = "commit-reassigned"  # switch or self-decode overtaken by a new assignment
    APPEND_FENCED = "append-fenced"
    APPEND_FAILED = "append-failed"        # nothing landed; a drafter proposes next
    SELF_APPEND_FAILED = "self-append-failed"  # nothing landed; self-decoding goes on
    SELF_END = "self-end"
    SELF_START = "self-start"              # a new session decoded by the verifier from its first token
    RESUMED_FINISHED = "resumed-finished"  # a resume whose committed tokens already end it


S = State
# (state, event) -> next state. Anything not listed is a protocol error of the caller.
TRANSITIONS: dict[tuple[State, Ev], State] = {
    (S.OPEN, Ev.ASSIGN): S.SERVING,
    (S.SERVING, Ev.ASSIGN): S.SERVING,
    (S.AWAITING_DRAFTER, Ev.ASSIGN): S.SERVING,
    (S.SELF_DECODING, Ev.ASSIGN): S.SERVING,         # the router wants a drafter again
    (S.VERIFYING, Ev.ASSIGN): S.VERIFYING,           # recorded; applies after the commit
    (S.COMMITTING, Ev.ASSIGN): S.COMMITTING,
    (S.SERVING, Ev.PROPOSE): S.VERIFYING,
    (S.SELF_DECODING, Ev.SELF_STEP): S.VERIFYING,
    (S.VERIFYING, Ev.RESULT): S.COMMITTING,
    (S.VERIFYING, Ev.REFUSED): S.SERVING,
    (S.VERIFYING, Ev.SELF_REFUSED): S.SELF_DECODING,
    (S.COMMITTING, Ev.COMMIT_CONTINUE): S.SERVING,
    (S.COMMITTING, Ev.COMMIT_SWITCH): S.AWAITING_DRAFTER,
    (S.COMMITTING, Ev.COMMIT_SELF): S.SELF_DECODING,
    (S.COMMITTING, Ev.COMMIT_FINISH): S.FINISHED,
    (S.COMMITTING, Ev.COMMIT_FAIL): S.FAILED,
    (S.COMMITTING, Ev.COMMIT_REASSIGNED): S.SERVING,
    (S.COMMITTING, Ev.APPEND_FENCED): S.FENCED,
    (S.COMMITTING, Ev.APPEND_FAILED): S.SERVING,
    (S.COMMITTING, Ev.SELF_APPEND_FAILED): S.SELF_DECODING,
    (S.SELF_DECODING, Ev.SELF_END): S.AWAITING_DRAFTER,
    (S.OPEN, Ev.SELF_START): S.SELF_DECODING,
    (S.OPEN, Ev.RESUMED_FINISHED): S.FINISHED,
}
CLOSED = frozenset({S.FINISHED, S.FAILED, S.FENCED})

# session-state's optional `state` member: the action that describes where the session is
# (absent while a drafter is proposing normally)
STATE_CODES = {
    S.SELF_DECODING: Action.SELF_DECODE,
    S.AWAITING_DRAFTER: Action.SWITCH,
    S.FINISHED: Action.FINISH,
    S.FAILED: Action.FAIL,
}


# the event a committed proposal round's verdict action takes the session through
_COMMIT_EVENTS = {
    Action.CONTINUE: Ev.COMMIT_CONTINUE, Action.REDUCE: Ev.COMMIT_CONTINUE,
    Action.SWITCH: Ev.COMMIT_SWITCH, Action.SELF_DECODE: Ev.COMMIT_SELF,
    Action.FINISH: Ev.COMMIT_FINISH, Action.FAIL: Ev.COMMIT_FAIL,
}


class ProtocolError(RuntimeError):
    """The caller drove the state machine out of order (a bug in the caller, never input)."""


@dataclass(frozen=True)
class Job:
    """One unit of verification: a proposal, or one self-decoded token (no proposal, M = 0)."""

    session: bytes
    epoch: int
    round: int
    rule: int
    sampling: Sampling | None          # profile in force for this round
    tokens: tuple[int, ...]            # [M] proposed tokens; () for a self-decoded token
    accept_uniforms: tuple[float, ...] # [M] purpose 0 at positions 1..M (empty under rule 1)
    draw_uniforms: tuple[float, ...]   # [M+1] purpose 1 at positions 1..M+1; the kernel uses a+1
    q_rows: str | None                 # cache reference of the [M, V] draft rows (rule 2)
    draft_kv: str | None
    self_decoded: bool
    request_key: tuple | None          # identity of the proposal, for in-flight retries

    @cached_property
    def m(self) -> int:   # read several times per job: worked out once
        return len(self.tokens)


@dataclass(frozen=True)
class PendingCommit:
    """A verified round waiting for its commit-log append."""

    record: CommitRecord
    verdict: Verdict | None     # None for a self-decoded token
    event: Ev
    counters: Counters          # escalation state once the round takes effect
    m_cap: int
    digest: bytes               # d[committed] once the round takes effect (computed once)


@dataclass(frozen=True)
class Replay:
    """A retried round whose verdict exists: answer with it unchanged."""

    verdict: Verdict


@dataclass(frozen=True)
class Wait:
    """An identical request for this round is being verified: wait for its verdict."""

    round: int


def request_key(p: Proposal) -> tuple:
    """What makes two proposals "identical" (the status report may differ between retries)."""
    return (p.session, p.epoch, p.round, p.drafter, p.base, p.base_digest, p.tokens,
            p.q_rows, p.draft_kv)


class VerifierSession:
    """All the verifier knows about one session, and the only code that changes it."""

    def __init__(self, msg: SessionOpen, prompt: Sequence[int], committed_tokens: Sequence[int],
                 round: int):
        contract = msg.contract
        self.id: bytes = msg.session
        self.epoch: int = msg.epoch
        self.router_epoch: int = msg.router_epoch or 0   # highest router ownership epoch seen
        self.contract: Contract = contract
        self.prompt: tuple[int, ...] = tuple(prompt)
        self.commit_log: str = msg.commit_log
        self.escalation = Escalation.of(contract)
        self.d0 = prefix_digest(contract.digest, self.prompt)
        self.output_tokens: list[int] = list(committed_tokens)   # committed output o[1..n]
        # d[n] only: every check reads the last digest, and keeping the chain d[0..n] would
        # cost ~70 bytes a token for the session's whole life (and a closed session's retention)
        self.digest: bytes = extend_digest(self.d0, self.output_tokens)
        self.round: int = round
        self.state: State = S.OPEN
        self.drafter: str | None = None
        self.m_cap: int = contract.m_max
        self.counters = Counters()
        self.self_tokens = 0                     # tokens committed in this self-decoding period
        self.policies: list[tuple[int, Sampling]] = []   # (from_round, profile), ascending
        self.verdicts: OrderedDict[int, Verdict] = OrderedDict()
        self.inflight: Job | None = None
        self.pending: PendingCommit | None = None
        self.assigned_during_job = False         # a refused or committed job returns to SERVING
        self.finish: Action | None = None        # FINISH or FAIL once closed
        self.events: list[Event] = []
        self._uniforms_cache: tuple[int | None, UniformSource] | None = None
        self._stops = frozenset(contract.stop)
        if self.committed >= contract.max_new or (self.output_tokens and self.output_tokens[-1] in contract.stop):
            self._move(Ev.RESUMED_FINISHED)
            self._close(Action.FINISH)

    # ------------------------------------------------------------------ creation

    @classmethod
    def open(cls, msg: SessionOpen, *, model_digest: bytes, prompt: Sequence[int],
             committed_tokens: Sequence[int] = ()) -> VerifierSession:
        """Validate a session-open (the IO layer resolved cache references into token lists).

        A fresh open starts at round 0 with nothing committed; a resume continues from the
        round, committed length and digest of the last commit record, checked against the
        committed tokens it names.
        """
        if msg.contract.target != model_digest:
            raise problem(Kind.BAD_CONTRACT, "contract target does not match this verifier's model")
        if msg.resume is None:
            if committed_tokens:
                raise ProtocolError("committed tokens without resume")
            return cls(msg, prompt, (), 0)
        resume = msg.resume
        if len(committed_tokens) != resume.committed:
            raise problem(Kind.CONFLICT, f"resume names {resume.committed} committed tokens, "
                                         f"the cache holds {len(committed_tokens)}")
        session = cls(msg, prompt, committed_tokens, resume.round)
        if session.digest != resume.digest:
            raise problem(Kind.CONFLICT, "committed tokens do not match the resume digest")
        return session

    # ------------------------------------------------------------------ views

    @property
    def committed(self) -> int:
        return len(self.output_tokens)

    @property
    def closed(self) -> bool:
        return self.state in CLOSED

    def state_message(self) -> SessionState:
        code = STATE_CODES.get(self.state)
        return SessionState(self.id, self.epoch, self.round, self.committed, self.digest,
                            None if code is None else int(code))

    def sampling_for(self, round: int) -> Sampling | None:
        """The profile in force for `round`: the latest policy with from_round <= round."""
        profile = self.contract.sampling
        for from_round, sampling in self.policies:
            if from_round <= round:
                profile = sampling
        return profile

    # ------------------------------------------------------------------ transitions

    def _move(self, event: Ev) -> None:
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise ProtocolError(f"{event.value} is not allowed in state {self.state.value}") from None

    def assign(self, msg: Assignment) -> SessionState:
        """PUT sessions/{id}/drafter: the drafter named here is the only one served."""
        self._check_epoch(msg.epoch)
        self.check_router(msg.router_epoch)
        if msg.contract.digest != self.contract.digest:
            raise problem(Kind.BAD_CONTRACT, "assignment carries another contract")
        if self.closed:
            raise self._closed_problem()
        self.drafter = msg.drafter
        self.m_cap = clamp_m_init(msg.m_init, self.contract.m_max)
        if self.state in (S.VERIFYING, S.COMMITTING):
            self.assigned_during_job = True
        self._move(Ev.ASSIGN)
        return self.state_message()

    def check_router(self, router_epoch: int | None) -> None:
        """An instruction from a router that owns the session with `router_epoch` (absent:
        a router that does not say): refused if a router with a higher one has spoken since,
        else the highest so far is remembered. This refuses a late instruction from a
        router that lost the session to another (docs/ARCHITECTURE.md)."""
        if router_epoch is None:
            return
        if router_epoch < self.router_epoch:
            raise problem(Kind.STALE_EPOCH, f"router epoch {router_epoch} is older than {self.router_epoch}: "
                                            "another router owns the session now")
        self.router_epoch = router_epoch

    def check(self, caller: str | None, p: Proposal) -> Replay | Wait | Job:
        """Section 6.3's checks, in the draft's order. Raises ProblemError on refusal."""
        # authorization
        if self.drafter is None or caller != self.drafter or p.drafter != self.drafter:
            raise problem(Kind.NOT_ASSIGNED, "the caller is not the drafter of the latest assignment")
        # fencing
        self._check_epoch(p.epoch)
        if self.state == S.FENCED:
            raise problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch")
        # idempotency
        stored = self.verdicts.get(p.round)
        if stored is not None:
            return Replay(stored)
        if self.inflight is not None and self.inflight.round == p.round:
            if self.inflight.request_key == request_key(p):
                return Wait(p.round)
            raise self._stale_base("another request for this round is being verified")
        if self.closed:
            raise self._closed_problem()
        if self.state in (S.AWAITING_DRAFTER, S.SELF_DECODING):
            raise problem(Kind.NOT_ASSIGNED, f"the session is {self.state.value}; wait for a new assignment")
        # base and round
        if p.base != self.committed or p.base_digest != self.digest:
            raise self._stale_base(f"base {p.base} is not the committed prefix {self.committed}")
        if p.round != self.round + 1 or self.state != S.SERVING:
            raise self._stale_base(f"round {p.round} does not follow round {self.round}")
        # limits
        limit = min(self.contract.m_max, self.m_cap)
        m = len(p.tokens)
        if m == 0 or m > limit:
            raise problem(Kind.LIMIT, f"M = {m} is outside 1..{limit} (m_max {self.contract.m_max}, m_cap {self.m_cap})")
        # preconditions of the rule (the q values themselves are checked by the kernel)
        if self.contract.rule == RULE_SPECULATIVE and p.q_rows is None:
            raise problem(Kind.BAD_PROPOSAL, "rule 2 needs q_rows")
        job = self._job(p.round, p.tokens, p.q_rows, p.draft_kv, request_key(p), self_decoded=False)
        self._move(Ev.PROPOSE)
        self.inflight = job
        return job

    def refuse(self, job: Job, prob: Problem) -> ProblemError:
        """The engine could not verify `job` (q rows unavailable, q(x) not positive): the
        round is not consumed and nothing is committed. Returns the error to raise."""
        self._expect_inflight(job, S.VERIFYING)
        self.inflight = None
        self._move(Ev.SELF_REFUSED if self._back_to_self_decoding(job) else Ev.REFUSED)
        self.assigned_during_job = False
        return ProblemError(prob)

    def complete(self, job: Job, accepted: int, extra: int, load: int,
                 plan: int | None = None) -> CommitRecord:
        """The verification result: a accepted tokens and the additional token. Returns the
        commit record to append; the verdict exists only after `committed(True)`.

        `plan`: the verifier's speculation plan for the session (control.plan_speculation),
        None for none: an M becomes the next m_cap (instead of the load rule of
        `next_m_cap`), SELF_DECODE (0) moves the session to self-decoding where the contract
        permits it at this load (section 6.5.2's self_decode, taken because speculation
        loses rather than because rounds were low: the ladder's counters are untouched).
        Finish, and any action the ladder takes, come first."""
        self._expect_inflight(job, S.VERIFYING)
        if not 0 <= accepted <= job.m:
            raise ProtocolError(f"accepted {accepted} outside 0..{job.m}")
        cut, finished = self._truncate((*job.tokens[:accepted], extra))
        emitted = tuple(cut)   # the record's and the verdict's (immutable: one tuple for both)
        committed = len(self.output_tokens) + len(emitted)
        digest = extend_digest(self.digest, emitted)
        record = CommitRecord(self.epoch, job.round, emitted, committed, digest)
        verdict: Verdict | None = None
        counters, m_cap = self.counters, self.m_cap
        if job.self_decoded:
            event = Ev.COMMIT_FINISH if finished else Ev.COMMIT_SELF
        else:
            counters, action, low = escalate(self.escalation, self.counters, accepted, job.m, load)
            if finished:
                action = Action.FINISH   # takes precedence over any escalation
            elif (plan == SELF_DECODE and action == Action.CONTINUE
                  and self_decode_permitted(self.escalation, load)):
                action = Action.SELF_DECODE
            if plan and action != Action.REDUCE:
                m_cap = max(1, min(self.contract.m_max, plan))
            else:
                m_cap = next_m_cap(self.m_cap, self.contract.m_max, action,
                                   is_low(accepted, job.m, self.escalation.low_ratio), load)
            verdict = Verdict(self.id, self.epoch, job.round, accepted, emitted, committed,
                              digest, action, m_cap, low, load)
            event = _COMMIT_EVENTS[action]
        self.pending = PendingCommit(record, verdict, event, counters, m_cap, digest)
        self._move(Ev.RESULT)
        return record

    def commit_result(self, appended: bool) -> Verdict | None:
        """The commit log's answer for the pending record. On success the round takes effect
        and its verdict (None for a self-decoded token) is returned; on a fenced append the
        round is discarded and the session is never served again."""
        if self.state != S.COMMITTING or self.pending is None:
            raise ProtocolError("no commit is pending")
        pending, self.pending = self.pending, None
        record, verdict, event = pending.record, pending.verdict, pending.event
        self.inflight = None
        if not appended:
            self._move(Ev.APPEND_FENCED)
            self.finish = None
            return None
        self.output_tokens.extend(record.emitted)
        self.digest = pending.digest
        self.round = record.round
        if verdict is not None:
            self.counters = pending.counters
            if not self.assigned_during_job:   # a new assignment's m_init stands
                self.m_cap = pending.m_cap
            self.verdicts[record.round] = verdict
            while len(self.verdicts) > REPLAY_WINDOW:
                self.verdicts.popitem(last=False)
        else:
            self.self_tokens += 1
        overtaken = self.assigned_during_job and event in (Ev.COMMIT_SWITCH, Ev.COMMIT_SELF)
        self._move(Ev.COMMIT_REASSIGNED if overtaken else event)   # the new assignment stands
        self.assigned_during_job = False
        if event == Ev.COMMIT_SELF and verdict is not None:
            self.self_tokens = 0          # a new self-decoding period starts
        elif event == Ev.COMMIT_SWITCH:
            self._emit(Action.SWITCH)
        elif event == Ev.COMMIT_FINISH:
            self._close(Action.FINISH)
        elif event == Ev.COMMIT_FAIL:
            self._close(Action.FAIL)
        self._forget_old_policies()
        return verdict

    def commit_failed(self) -> None:
        """The append could not be made (store unreachable, timeout): nothing is released and
        the round is not consumed. Had the record landed after all, the next append finds the
        log longer than expected and the session stops being served, so a lost
        acknowledgement can never fork the output."""
        if self.state != S.COMMITTING or self.pending is None:
            raise ProtocolError("no commit is pending")
        job, self.inflight = self.inflight, None
        self.pending = None
        self._move(Ev.SELF_APPEND_FAILED if self._back_to_self_decoding(job) else Ev.APPEND_FAILED)
        self.assigned_during_job = False

    def next_self_job(self, load: int) -> Job | None:
        """While self-decoding: the next token's job, or None when the period ends (self_max
        tokens, or load above self_load), which also queues the event for the router."""
        if self.state != S.SELF_DECODING:
            return None
        limit = self.contract.self_max
        if (limit is not None and self.self_tokens >= limit) or not self_decode_permitted(self.escalation, load):
            self.end_self_decoding()
            return None
        job = self._job(self.round + 1, (), None, None, None, self_decoded=True)
        self._move(Ev.SELF_STEP)
        self.inflight = job
        return job

    def start_self_decoding(self, load: int) -> bool:
        """A session just opened starts self-decoding (the verifier's speculation plan says
        a drafter would not pay for it now), where the contract permits self-decoding at
        this load. The session-state of the open then says so (`state` self_decode), and
        the router assigns a drafter only when the period ends (its event), as after a
        self-decoding period the ladder started. True if it started."""
        if self.state != S.OPEN or not self_decode_permitted(self.escalation, load):
            return False
        self._move(Ev.SELF_START)
        self.self_tokens = 0
        return True

    def end_self_decoding(self) -> None:
        """End the self-decoding period (also when the verifier cannot go on) and queue the
        event that asks the router for a drafter."""
        if self.state == S.SELF_DECODING:
            self._move(Ev.SELF_END)
            self._emit(Action.SELF_DECODE)

    def policy(self, msg: Policy) -> SessionState:
        """POST sessions/{id}/policy: a new profile for rounds >= from_round."""
        self.check_router(msg.router_epoch)
        if self.closed:
            raise self._closed_problem()
        latest = self.inflight.round if self.inflight is not None else self.round
        if msg.from_round <= latest:
            raise problem(Kind.CONFLICT, f"from_round {msg.from_round} is not after round {latest}")
        if len(self.policies) >= MAX_PENDING_POLICIES:
            raise problem(Kind.CONFLICT, "too many pending policy updates")
        self.policies = sorted([*(x for x in self.policies if x[0] != msg.from_round),
                                (msg.from_round, msg.sampling)], key=lambda x: x[0])
        return self.state_message()

    def output(self, start: int) -> Output | None:
        """Committed tokens from output index `start`; None when there are none yet (the
        caller waits and asks again). Only tokens whose commit record was appended exist."""
        if self.state == S.FENCED:
            raise problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch")
        if start > self.committed:
            if self.closed:
                raise problem(Kind.BAD_REQUEST, f"from={start} is past the final output ({self.committed})")
            return None
        tokens = tuple(self.output_tokens[start:])
        if not tokens and not self.closed:
            return None
        final = self.closed
        return Output(self.id, self.epoch, start, tokens, final, self.finish if final else None)

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ helpers

    def _job(self, round: int, tokens: tuple[int, ...], q_rows: str | None, draft_kv: str | None,
             key: tuple | None, *, self_decoded: bool) -> Job:
        sampling = self.sampling_for(round)
        # a self-decoded token (M = 0) is its own round and uses (round, i = 1, purpose 1):
        # exactly the one draw uniform round_uniforms gives for M = 0
        if self.contract.rule == RULE_SPECULATIVE:
            accept, draws = round_uniforms(self._source(sampling), round, len(tokens))
        else:
            accept, draws = [], []
        return Job(self.id, self.epoch, round, self.contract.rule, sampling, tuple(tokens),
                   tuple(accept), tuple(draws), q_rows, draft_kv, self_decoded, key)

    def _source(self, sampling: Sampling | None) -> UniformSource:
        seed = None if sampling is None else sampling.seed
        if self._uniforms_cache is None or self._uniforms_cache[0] != seed:
            self._uniforms_cache = (seed, uniform_source(seed, self.id))
        return self._uniforms_cache[1]

    def _truncate(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Cut after the first stop token (kept) and at max_new; True when either ends it."""
        committed, max_new = len(self.output_tokens), self.contract.max_new
        emitted = list(tokens[:max(0, max_new - committed)])
        if not self._stops.isdisjoint(emitted):   # rare: look for the first stop token
            for n, token in enumerate(emitted):
                if token in self._stops:
                    return emitted[:n + 1], True
        return emitted, committed + len(emitted) >= max_new

    def _expect_inflight(self, job: Job, state: State) -> None:
        if self.inflight is not job or self.state != state:
            raise ProtocolError(f"job for round {job.round} is not the one in flight")

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise problem(Kind.STALE_EPOCH, f"epoch {epoch} is not the session epoch {self.epoch}")

    def _stale_base(self, detail: str) -> ProblemError:
        return ProblemError(Problem(Kind.STALE_BASE, detail, state=self.state_message().to_obj()))

    def _closed_problem(self) -> ProblemError:
        if self.state == S.FENCED:
            return problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch")
        return problem(Kind.SESSION_CLOSED, f"the session has {self.state.value}")

    def _back_to_self_decoding(self, job: Job) -> bool:
        """Where a job that did not commit returns: a self-decoded one to self-decoding,
        unless the router assigned a drafter meanwhile."""
        return job.self_decoded and not self.assigned_during_job

    def _close(self, how: Action) -> None:
        """The session has finished or failed (the table has already moved it there)."""
        self.finish = how
        self._emit(how)

    def _emit(self, kind: Action) -> None:
        self.events.append(Event(self.id, self.epoch, kind, self.committed, self.digest))

    def _forget_old_policies(self) -> None:
        # keep only the newest policy already in force, and those still to come
        if not self.policies:
            return
        active = [x for x in self.policies if x[0] <= self.round + 1]
        self.policies = active[-1:] + [x for x in self.policies if x[0] > self.round + 1]
