"""The session state machine against its own table: every (state, event) pair is driven
through the public methods. A pair in `TRANSITIONS` must move the session to the table's
state (and through `_move`, the one place that writes `state`); a pair that is not in the
table must be refused or ignored, leaving the session where it was."""

from __future__ import annotations

import ast
import inspect
import itertools

import pytest
from test_session import (
    DRAFTER,
    MODEL,
    OTHER,
    PROMPT,
    SID,
    assignment,
    make_contract,
    open_session,
    propose,
)

from sdcp_fast.core import session as session_module
from sdcp_fast.core.digest import chain, prefix_digest
from sdcp_fast.core.messages import Action, Resume, SessionOpen
from sdcp_fast.core.problems import Kind, Problem, ProblemError
from sdcp_fast.core.session import TRANSITIONS, Ev, Job, ProtocolError, State, VerifierSession

S = State

# contracts that make one round end in a given way (one low round escalates at once)
CONTRACTS = {
    "continue": dict(low_rounds=2),
    "switch": dict(low_rounds=1, fallback=(Action.SWITCH,)),
    "self": dict(low_rounds=1, fallback=(Action.SELF_DECODE,), self_load=100, self_max=8),
    "fail": dict(low_rounds=1, fallback=(Action.FAIL,)),
    "finish": dict(max_new=2),
}


def served(how: str = "continue") -> VerifierSession:
    return open_session(make_contract(**CONTRACTS[how]))


def drafter_job(s: VerifierSession) -> Job:
    job = s.check(DRAFTER, propose(s, tokens=(1, 2)))
    assert isinstance(job, Job)
    return job


def committed_round(s: VerifierSession, accepted: int, extra: int = 1) -> VerifierSession:
    s.complete(drafter_job(s), accepted, extra, 0)
    s.commit_result(True)
    return s


def self_decoding() -> VerifierSession:
    s = committed_round(served("self"), accepted=0)
    assert s.state == S.SELF_DECODING
    return s


def self_job_out() -> VerifierSession:
    s = self_decoding()
    assert s.next_self_job(load=0) is not None
    return s


def committing(how: str, accepted: int, *, self_job: bool = False, reassign: bool = False) -> VerifierSession:
    if self_job:
        s = self_job_out()
        s.complete(s.inflight, 0, 7, 0)
    else:
        s = served(how)
        s.complete(drafter_job(s), accepted, 1, 0)
    if reassign:
        s.assign(assignment(s, drafter=OTHER))
    assert s.state == S.COMMITTING
    return s


def resumed_at_the_end() -> VerifierSession:
    """An open whose resume already holds max_new tokens: the session is born finished."""
    contract = make_contract(max_new=2)
    out = [10, 11]
    digest = chain(prefix_digest(contract.digest, PROMPT), out)[-1]
    msg = SessionOpen(SID, 2, contract, PROMPT, "file:/log", resume=Resume(3, 2, digest, "mlc:/out"))
    return VerifierSession.open(msg, model_digest=MODEL, prompt=PROMPT, committed_tokens=out)


# How to bring a session into each state; (state, event) entries prepare what that event needs.
REACH = {
    S.OPEN: lambda: open_session(assign=False),
    (S.OPEN, Ev.SELF_START): lambda: open_session(make_contract(**CONTRACTS["self"]), assign=False),
    S.SERVING: served,
    S.VERIFYING: lambda: (lambda s: (drafter_job(s), s)[1])(served()),
    (S.VERIFYING, Ev.SELF_REFUSED): self_job_out,
    S.COMMITTING: lambda: committing("continue", accepted=2),
    (S.COMMITTING, Ev.COMMIT_SWITCH): lambda: committing("switch", accepted=0),
    (S.COMMITTING, Ev.COMMIT_SELF): lambda: committing("self", accepted=0),
    (S.COMMITTING, Ev.COMMIT_FINISH): lambda: committing("finish", accepted=2),
    (S.COMMITTING, Ev.COMMIT_FAIL): lambda: committing("fail", accepted=0),
    (S.COMMITTING, Ev.COMMIT_REASSIGNED): lambda: committing("switch", accepted=0, reassign=True),
    (S.COMMITTING, Ev.SELF_APPEND_FAILED): lambda: committing("self", 0, self_job=True),
    S.SELF_DECODING: self_decoding,
    S.AWAITING_DRAFTER: lambda: committed_round(served("switch"), accepted=0),
    S.FINISHED: lambda: committed_round(served("finish"), accepted=2),
    S.FAILED: lambda: committed_round(served("fail"), accepted=0),
    S.FENCED: lambda: (lambda s: (s.commit_result(False), s)[1])(committing("continue", accepted=2)),
}


def stray_job(s: VerifierSession) -> Job:
    return s.inflight if s.inflight is not None else Job(SID, s.epoch, s.round + 1, 1, None, (1,), (), (0.5,),
                                                         None, None, False, None)


def refuse(s: VerifierSession) -> None:
    s.refuse(stray_job(s), Problem(Kind.Q_UNAVAILABLE))


# The public call that fires each event (what the verifier role does to cause it).
FIRE = {
    Ev.ASSIGN: lambda s: s.assign(assignment(s)),
    Ev.PROPOSE: lambda s: s.check(DRAFTER, propose(s)),
    Ev.SELF_STEP: lambda s: s.next_self_job(load=0),
    Ev.RESULT: lambda s: s.complete(stray_job(s), 0, 1, 0),
    Ev.REFUSED: refuse,
    Ev.SELF_REFUSED: refuse,
    Ev.COMMIT_CONTINUE: lambda s: s.commit_result(True),
    Ev.COMMIT_SWITCH: lambda s: s.commit_result(True),
    Ev.COMMIT_SELF: lambda s: s.commit_result(True),
    Ev.COMMIT_FINISH: lambda s: s.commit_result(True),
    Ev.COMMIT_FAIL: lambda s: s.commit_result(True),
    Ev.COMMIT_REASSIGNED: lambda s: s.commit_result(True),
    Ev.APPEND_FENCED: lambda s: s.commit_result(False),
    Ev.APPEND_FAILED: lambda s: s.commit_failed(),
    Ev.SELF_APPEND_FAILED: lambda s: s.commit_failed(),
    Ev.SELF_END: lambda s: s.end_self_decoding(),
    Ev.SELF_START: lambda s: s.start_self_decoding(load=0),
    # only an open fires it, on the session it creates (which starts in OPEN)
    Ev.RESUMED_FINISHED: lambda s: resumed_at_the_end() if s.state == S.OPEN else None,
}


@pytest.fixture
def moves(monkeypatch):
    """Every (state, event) the session moves through, recorded at `_move`."""
    taken: list[tuple[State, Ev]] = []
    original = VerifierSession._move

    def recording(self, event):
        before = self.state
        original(self, event)
        taken.append((before, event))

    monkeypatch.setattr(VerifierSession, "_move", recording)
    return taken


def test_every_event_has_a_firing_call_and_every_state_a_way_there():
    assert set(FIRE) == set(Ev)
    assert {key for key in REACH if isinstance(key, State)} == set(State)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Ev)),
                         ids=lambda x: x.value)
def test_state_event_pair_against_the_table(state, event, moves):
    session = REACH.get((state, event), REACH[state])()
    assert session.state == state
    moves.clear()
    try:
        result = FIRE[event](session)
        if isinstance(result, VerifierSession):   # the open that created a session
            session = result
        refused = False
    except (ProblemError, ProtocolError):
        refused = True
    if (state, event) in TRANSITIONS:
        assert not refused
        assert moves == [(state, event)]
        assert session.state == TRANSITIONS[(state, event)]
    else:
        assert (state, event) not in moves
        assert session.state == state, f"{event.value} moved {state.value} without a table row"


def test_an_open_that_resumes_at_the_end_is_born_finished(moves):
    s = resumed_at_the_end()
    assert moves == [(S.OPEN, Ev.RESUMED_FINISHED)]
    assert s.state == S.FINISHED and s.finish == Action.FINISH
    assert [e.kind for e in s.take_events()] == [Action.FINISH]


def test_only_move_writes_the_state():
    """`state` is assigned in `__init__` (OPEN) and in `_move`, nowhere else."""
    tree = ast.parse(inspect.getsource(session_module))
    writers = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
                if any(isinstance(t, ast.Attribute) and t.attr == "state" for t in targets):
                    writers.add(fn.name)
    assert writers == {"__init__", "_move"}
