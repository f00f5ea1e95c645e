"""The verifier's session state machine, tested the way h11 tests its own: drive it with
messages, check every answer field by field."""

from __future__ import annotations

import pytest

from sdcp_fast.core import rng
from sdcp_fast.core.digest import chain, extend_digest, prefix_digest
from sdcp_fast.core.messages import (
    Action,
    Assignment,
    Contract,
    Policy,
    Proposal,
    Sampling,
    SessionOpen,
    Status,
)
from sdcp_fast.core.problems import Kind, ProblemError
from sdcp_fast.core.session import (
    TRANSITIONS,
    Job,
    ProtocolError,
    Replay,
    State,
    VerifierSession,
    Wait,
)

MODEL = b"T" * 32
SID = bytes(range(16))
DRAFTER = "https://drafter-1.test:8443/"
OTHER = "https://drafter-2.test:8443/"
PROMPT = (5, 6, 7)


def make_contract(**overrides) -> Contract:
    fields = dict(target=MODEL, tokenizer=b"K" * 32, rule=1, m_max=8, max_new=100, stop=(99,),
                  low_rounds=2, fallback=(Action.REDUCE, Action.SWITCH))
    fields.update(overrides)
    return Contract(**fields)


def open_session(contract=None, epoch=1, assign=True, m_init=4) -> VerifierSession:
    contract = contract or make_contract()
    msg = SessionOpen(SID, epoch, contract, PROMPT, "file:/log/1")
    session = VerifierSession.open(msg, model_digest=MODEL, prompt=PROMPT)
    if assign:
        session.assign(assignment(session, m_init=m_init))
    return session


def assignment(session, drafter=DRAFTER, m_init=4, epoch=None) -> Assignment:
    return Assignment(SID, session.epoch if epoch is None else epoch, session.contract,
                      "https://verifier.test/", drafter, PROMPT, session.round, session.committed,
                      session.digest, m_init)


STATUS = Status(DRAFTER, 1, 10, 0, 1000)


def propose(session, tokens=(1, 2, 3), **overrides) -> Proposal:
    fields = dict(session=SID, epoch=session.epoch, round=session.round + 1, drafter=DRAFTER,
                  base=session.committed, base_digest=session.digest, tokens=tuple(tokens),
                  status=STATUS)
    if session.contract.rule == 2:
        fields["q_rows"] = "mlc://q/1"
    fields.update(overrides)
    return Proposal(**fields)


def run_round(session, tokens=(1, 2, 3), accepted=3, extra=42, load=10, appended=True):
    job = session.check(DRAFTER, propose(session, tokens))
    assert isinstance(job, Job)
    record = session.complete(job, accepted, extra, load)
    return job, record, session.commit_result(appended)


def problem_of(fn, *args) -> Kind:
    with pytest.raises(ProblemError) as exc:
        fn(*args)
    return exc.value.problem


# ----------------------------------------------------------------------------- opening

def test_fresh_open_state():
    s = open_session(assign=False)
    st = s.state_message()
    assert (st.session, st.epoch, st.round, st.committed, st.state) == (SID, 1, 0, 0, None)
    assert st.digest == prefix_digest(s.contract.digest, PROMPT)
    assert s.state == State.OPEN


def test_open_refuses_another_model():
    msg = SessionOpen(SID, 1, make_contract(), PROMPT, "file:/log")
    p = problem_of(lambda: VerifierSession.open(msg, model_digest=b"X" * 32, prompt=PROMPT))
    assert (p.kind, p.status) == (Kind.BAD_CONTRACT, 422)


def test_resume_checks_committed_tokens_against_digest():
    contract = make_contract()
    out = [10, 11, 12]
    digest = chain(prefix_digest(contract.digest, PROMPT), out)[-1]
    from sdcp_fast.core.messages import Resume
    msg = SessionOpen(SID, 2, contract, PROMPT, "file:/log", resume=Resume(7, 3, digest, "mlc://out"))
    s = VerifierSession.open(msg, model_digest=MODEL, prompt=PROMPT, committed_tokens=out)
    assert (s.round, s.committed, s.digest, s.epoch) == (7, 3, digest, 2)
    p = problem_of(lambda: VerifierSession.open(msg, model_digest=MODEL, prompt=PROMPT,
                                                committed_tokens=[10, 11, 13]))
    assert p.kind == Kind.CONFLICT


# ----------------------------------------------------------------------------- section 6.3 checks, in order

def test_not_assigned_before_any_assignment():
    s = open_session(assign=False)
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.NOT_ASSIGNED


def test_wrong_drafter_is_403_even_with_other_errors():
    s = open_session()
    p = problem_of(s.check, OTHER, propose(s, epoch=9, base=5))
    assert (p.kind, p.status) == (Kind.NOT_ASSIGNED, 403)
    # the body's drafter must be the caller too
    assert problem_of(s.check, DRAFTER, propose(s, drafter=OTHER)).kind == Kind.NOT_ASSIGNED


def test_reassignment_moves_authority():
    s = open_session()
    s.assign(assignment(s, drafter=OTHER))
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.NOT_ASSIGNED


def test_stale_epoch_before_base_check():
    s = open_session()
    p = problem_of(s.check, DRAFTER, propose(s, epoch=2, base=7))
    assert (p.kind, p.status) == (Kind.STALE_EPOCH, 409)


def test_stale_base_carries_session_state():
    s = open_session()
    run_round(s)
    p = problem_of(s.check, DRAFTER, propose(s, base=0, base_digest=s.d0))
    assert (p.kind, p.status) == (Kind.STALE_BASE, 409)
    assert p.state == s.state_message().to_obj()
    doc = p.to_dict()
    assert doc["type"].endswith("sdcp-stale-base")
    assert doc["state"]["digest"] == s.digest.hex()
    assert doc["state"]["committed"] == 4


def test_wrong_digest_is_stale_base():
    s = open_session()
    assert problem_of(s.check, DRAFTER, propose(s, base_digest=b"\0" * 32)).kind == Kind.STALE_BASE


def test_skipped_round_is_stale_base():
    s = open_session()
    assert problem_of(s.check, DRAFTER, propose(s, round=2)).kind == Kind.STALE_BASE


def test_m_over_m_cap_and_m_zero_are_limit():
    s = open_session(m_init=3)
    p = problem_of(s.check, DRAFTER, propose(s, tokens=(1, 2, 3, 4)))
    assert (p.kind, p.status) == (Kind.LIMIT, 422)
    assert problem_of(s.check, DRAFTER, propose(s, tokens=())).kind == Kind.LIMIT
    assert isinstance(s.check(DRAFTER, propose(s, tokens=(1, 2, 3))), Job)


def test_m_init_clamped_to_m_max():
    s = open_session(m_init=50)
    assert s.m_cap == 8
    assert problem_of(s.check, DRAFTER, propose(s, tokens=tuple(range(9)))).kind == Kind.LIMIT


def test_rule2_without_q_rows_is_bad_proposal():
    s = open_session(make_contract(rule=2))
    p = problem_of(s.check, DRAFTER, propose(s, q_rows=None))
    assert (p.kind, p.status) == (Kind.BAD_PROPOSAL, 422)


def test_zero_q_value_refused_without_consuming_the_round():
    from sdcp_fast.core.problems import Problem
    s = open_session(make_contract(rule=2))
    job = s.check(DRAFTER, propose(s))
    err = s.refuse(job, Problem(Kind.BAD_PROPOSAL, "q[2](x[2]) = 0"))
    assert err.problem.kind == Kind.BAD_PROPOSAL
    assert (s.state, s.round, s.committed) == (State.SERVING, 0, 0)
    assert isinstance(s.check(DRAFTER, propose(s)), Job)   # the same round may be proposed again


def test_q_unavailable_refusal():
    from sdcp_fast.core.problems import Problem
    s = open_session(make_contract(rule=2))
    job = s.check(DRAFTER, propose(s))
    err = s.refuse(job, Problem(Kind.Q_UNAVAILABLE, "cache miss"))
    assert (err.problem.kind, err.problem.status) == (Kind.Q_UNAVAILABLE, 409)
    assert s.round == 0


# ----------------------------------------------------------------------------- idempotency

def test_retried_round_gets_identical_verdict():
    s = open_session()
    prop = propose(s)
    job = s.check(DRAFTER, prop)
    s.complete(job, 2, 42, 10)
    verdict = s.commit_result(True)
    replay = s.check(DRAFTER, prop.replace(status=Status(DRAFTER, 1, 99, 5, 1000)))
    assert isinstance(replay, Replay) and replay.verdict == verdict
    assert replay.verdict.to_cbor() == verdict.to_cbor()


def test_identical_request_in_flight_waits_and_different_one_is_refused():
    s = open_session()
    prop = propose(s)
    job = s.check(DRAFTER, prop)
    assert s.check(DRAFTER, prop) == Wait(1)
    assert problem_of(s.check, DRAFTER, propose(s, tokens=(9, 9))).kind == Kind.STALE_BASE
    s.complete(job, 3, 1, 0)
    assert s.check(DRAFTER, prop) == Wait(1)       # still in flight while committing
    verdict = s.commit_result(True)
    assert s.check(DRAFTER, prop) == Replay(verdict)


# ----------------------------------------------------------------------------- commit

def test_verdict_fields():
    s = open_session()
    d0 = s.digest
    job, record, verdict = run_round(s, tokens=(1, 2, 3), accepted=2, extra=42, load=30)
    assert record.emitted == (1, 2, 42)
    assert (record.epoch, record.round, record.committed) == (1, 1, 3)
    assert record.digest == extend_digest(d0, [1, 2, 42])
    assert (verdict.session, verdict.epoch, verdict.round) == (SID, 1, 1)
    assert (verdict.accepted, verdict.emitted, verdict.committed) == (2, (1, 2, 42), 3)
    assert verdict.digest == record.digest
    assert (verdict.action, verdict.low, verdict.load) == (Action.CONTINUE, 0, 30)
    assert verdict.m_cap == 5       # restored by one: not low, load permits
    assert s.state_message().round == 1


def test_nothing_is_visible_before_the_append():
    s = open_session()
    job = s.check(DRAFTER, propose(s))
    s.complete(job, 3, 42, 0)
    assert s.output(0) is None and s.committed == 0 and s.round == 0
    s.commit_result(True)
    out = s.output(0)
    assert out.tokens == (1, 2, 3, 42) and out.final is False


def test_fenced_append_releases_nothing_and_stops_serving():
    s = open_session()
    run_round(s)
    before = (s.committed, s.digest, s.round)
    job = s.check(DRAFTER, propose(s))
    s.complete(job, 3, 7, 0)
    assert s.commit_result(False) is None
    assert (s.committed, s.digest, s.round) == before
    assert s.state == State.FENCED
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.STALE_EPOCH
    assert problem_of(s.output, 0).kind == Kind.STALE_EPOCH
    assert problem_of(s.assign, assignment(s)).kind == Kind.STALE_EPOCH
    assert s.take_events() == []


def test_stop_token_truncates_and_finishes():
    s = open_session()
    job, record, verdict = run_round(s, tokens=(1, 99, 3), accepted=3, extra=5)
    assert verdict.emitted == (1, 99) and verdict.accepted == 3
    assert verdict.action == Action.FINISH
    assert s.state == State.FINISHED
    out = s.output(0)
    assert (out.tokens, out.final, out.finish) == ((1, 99), True, Action.FINISH)
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.SESSION_CLOSED
    [event] = s.take_events()
    assert (event.kind, event.committed, event.digest) == (Action.FINISH, 2, s.digest)


def test_max_new_truncates_and_finish_beats_escalation():
    s = open_session(make_contract(max_new=5, low_rounds=1, fallback=(Action.FAIL,)))
    run_round(s, accepted=3, extra=4)
    job, record, verdict = run_round(s, tokens=(1, 2), accepted=0, extra=8)
    assert verdict.emitted == (8,)
    assert verdict.action == Action.FINISH     # the round is low (a=0) and R=1, yet finish wins
    assert verdict.low == 1


def test_output_cursor_and_final():
    s = open_session(make_contract(max_new=6))
    run_round(s, accepted=3, extra=4)
    assert s.output(2).tokens == (3, 4)
    assert s.output(4) is None                  # nothing yet: the caller waits
    run_round(s, tokens=(5, 6), accepted=2, extra=7)
    out = s.output(4)
    assert (out.start, out.tokens, out.final, out.finish) == (4, (5, 6), True, Action.FINISH)
    assert s.output(6).tokens == () and s.output(6).final
    assert problem_of(s.output, 7).kind == Kind.BAD_REQUEST


# ----------------------------------------------------------------------------- escalation through the session

def test_reduce_then_switch_with_events():
    s = open_session(make_contract(low_rounds=2, fallback=(Action.REDUCE, Action.SWITCH)), m_init=8)
    _, _, v1 = run_round(s, accepted=0, extra=1)
    assert (v1.action, v1.low) == (Action.CONTINUE, 1)
    _, _, v2 = run_round(s, accepted=0, extra=1)
    assert (v2.action, v2.low) == (Action.REDUCE, 2)
    assert v2.m_cap == v1.m_cap // 2
    run_round(s, accepted=0, extra=1)
    _, _, v4 = run_round(s, accepted=0, extra=1)
    assert v4.action == Action.SWITCH
    assert s.state == State.AWAITING_DRAFTER
    [event] = s.take_events()
    assert (event.kind, event.committed) == (Action.SWITCH, 4)
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.NOT_ASSIGNED
    s.assign(assignment(s, drafter=OTHER))
    assert isinstance(s.check(OTHER, propose(s, drafter=OTHER)), Job)


def test_fail_action_closes_the_session():
    s = open_session(make_contract(low_rounds=1, fallback=(Action.FAIL,)))
    _, _, v = run_round(s, accepted=0, extra=1)
    assert v.action == Action.FAIL
    assert s.state == State.FAILED
    out = s.output(0)
    assert out.final and out.finish == Action.FAIL
    assert s.take_events()[0].kind == Action.FAIL
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.SESSION_CLOSED


def test_self_decoding_rounds_and_end_event():
    contract = make_contract(rule=2, low_rounds=1, fallback=(Action.SELF_DECODE, Action.FAIL),
                             self_load=50, self_max=3, sampling=Sampling(seed=7))
    s = open_session(contract)
    _, _, v = run_round(s, accepted=0, extra=1, load=20)
    assert v.action == Action.SELF_DECODE and s.state == State.SELF_DECODING
    assert s.state_message().state == int(Action.SELF_DECODE)
    assert problem_of(s.check, DRAFTER, propose(s)).kind == Kind.NOT_ASSIGNED
    rounds = []
    for token in (20, 21, 22):
        job = s.next_self_job(load=20)
        assert job.self_decoded and job.m == 0 and job.round == s.round + 1
        assert job.draw_uniforms == (rng.verify_uniform(7, SID, job.round, 1, 1),)
        rounds.append(job.round)
        s.complete(job, 0, token, 20)
        assert s.commit_result(True) is None     # no verdict for a self-decoded round
    assert rounds == [2, 3, 4]
    assert s.next_self_job(load=20) is None      # self_max reached
    assert s.state == State.AWAITING_DRAFTER
    [event] = s.take_events()
    assert (event.kind, event.committed) == (Action.SELF_DECODE, 4)
    assert s.output(1).tokens == (20, 21, 22)
    s.assign(assignment(s))
    _, _, v = run_round(s, accepted=0, extra=1, load=20)
    assert v.action == Action.FAIL               # j persisted across the self-decoding period


def test_self_decoding_stops_when_load_exceeds_self_load():
    contract = make_contract(low_rounds=1, fallback=(Action.SELF_DECODE,), self_load=50)
    s = open_session(contract)
    run_round(s, accepted=0, extra=1, load=20)
    job = s.next_self_job(load=20)
    s.complete(job, 0, 5, 20)
    s.commit_result(True)
    assert s.next_self_job(load=51) is None
    assert s.take_events()[0].kind == Action.SELF_DECODE


def test_verifier_uniforms_follow_the_draft():
    contract = make_contract(rule=2, sampling=Sampling(seed=123))
    s = open_session(contract)
    job = s.check(DRAFTER, propose(s, tokens=(4, 5)))
    assert job.accept_uniforms == tuple(rng.verify_uniform(123, SID, 1, i, 0) for i in (1, 2))
    assert job.draw_uniforms == tuple(rng.verify_uniform(123, SID, 1, i, 1) for i in (1, 2, 3))


def test_unseeded_uniforms_come_from_the_csprng():
    s = open_session(make_contract(rule=2))
    job = s.check(DRAFTER, propose(s, tokens=(4, 5)))
    assert len(job.accept_uniforms) == 2 and len(set(job.draw_uniforms)) == 3
    assert all(0 <= u < 1 for u in job.accept_uniforms + job.draw_uniforms)


# ----------------------------------------------------------------------------- policy

def test_policy_applies_from_round():
    s = open_session(make_contract(rule=2, sampling=Sampling(seed=1)))
    s.policy(Policy(SID, 2, Sampling(temperature_milli=500, seed=2)))
    job = s.check(DRAFTER, propose(s))
    assert job.sampling == Sampling(seed=1)
    s.complete(job, 3, 0, 0)
    s.commit_result(True)
    job = s.check(DRAFTER, propose(s))
    assert job.sampling == Sampling(temperature_milli=500, seed=2)
    assert job.accept_uniforms[0] == rng.verify_uniform(2, SID, 2, 1, 0)
    assert problem_of(s.policy, Policy(SID, 2, Sampling())).kind == Kind.CONFLICT


# ----------------------------------------------------------------------------- the table itself

def test_out_of_order_driving_is_a_protocol_error():
    s = open_session()
    with pytest.raises(ProtocolError):
        s.commit_result(True)
    job = s.check(DRAFTER, propose(s))
    with pytest.raises(ProtocolError):
        s.complete(job, 9, 0, 0)      # accepted > M


def test_transition_table_has_no_exit_from_closed_states():
    for (state, _event), _next in TRANSITIONS.items():
        assert state not in (State.FINISHED, State.FAILED, State.FENCED)


def test_assignment_epoch_and_contract_checked():
    s = open_session()
    assert problem_of(s.assign, assignment(s, epoch=5)).kind == Kind.STALE_EPOCH
    other = assignment(s).replace(contract=make_contract(max_new=7))
    assert problem_of(s.assign, other).kind == Kind.BAD_CONTRACT


def test_reassignment_during_a_job_keeps_its_m_init():
    s = open_session(make_contract(low_rounds=1, fallback=(Action.REDUCE, Action.REDUCE)), m_init=8)
    _, _, v = run_round(s, accepted=0, extra=1)
    assert v.m_cap == 4                                   # reduced
    job = s.check(DRAFTER, propose(s, tokens=(1,)))
    s.assign(assignment(s, drafter=OTHER, m_init=8))      # the router moves the session mid-round
    s.complete(job, 0, 1, 0)
    s.commit_result(True)
    assert s.m_cap == 8
    assert isinstance(s.check(OTHER, propose(s, tokens=tuple(range(8)), drafter=OTHER)), Job)


def test_sampling_outside_the_contract_ignores_unknown_keys():
    from sdcp_fast.core.messages import MessageError
    p = Policy.from_obj({"session": SID, "from_round": 3, "sampling": {"seed": 4, "future": 1}})
    assert p.sampling == Sampling(seed=4)
    with pytest.raises(MessageError) as exc:
        Policy.from_obj({"session": SID, "from_round": 3, "sampling": {"top_p_milli": 2000}})
    assert exc.value.problem.kind == Kind.BAD_REQUEST
    with pytest.raises(ProblemError) as exc:   # inside the contract the map stays closed
        make_contract(sampling={"seed": 4, "future": 1})
    assert exc.value.problem.kind == Kind.BAD_CONTRACT


def test_instructions_from_a_router_that_lost_the_session_are_refused():
    """router_epoch (the extension member): the highest one seen is kept; an assignment or a
    policy carrying a lower one is refused (sdcp-stale-epoch) and changes nothing; one that
    does not carry it is taken as before."""
    session = open_session(assign=False)
    session.assign(assignment(session).replace(router_epoch=1))
    session.assign(assignment(session, drafter=OTHER).replace(router_epoch=2))   # a new owner
    assert session.router_epoch == 2 and session.drafter == OTHER
    late = assignment(session, drafter=DRAFTER).replace(router_epoch=1)           # the old owner, late
    assert problem_of(session.assign, late).kind == Kind.STALE_EPOCH
    assert session.drafter == OTHER
    policy = Policy(SID, 5, Sampling(temperature_milli=0), router_epoch=1)
    assert problem_of(session.policy, policy).kind == Kind.STALE_EPOCH and session.policies == []
    session.policy(policy.replace(router_epoch=2))
    session.assign(assignment(session, drafter=DRAFTER))                          # no member: as before
    assert session.drafter == DRAFTER and session.router_epoch == 2
    reopened = VerifierSession.open(SessionOpen(SID, 2, make_contract(), PROMPT, "file:/log/1", router_epoch=3),
                                    model_digest=MODEL, prompt=PROMPT)
    assert reopened.router_epoch == 3
    # the member travels in CBOR and is left out when absent (the draft's messages unchanged)
    a = assignment(session)
    assert Assignment.from_cbor(a.replace(router_epoch=7).to_cbor()).router_epoch == 7
    assert "router_epoch" not in a.to_obj()


def test_a_session_keeps_one_digest_not_one_per_token():
    """Bounded memory (issue 21's soak): d[n] is all any check reads, so a session's state grows
    with its output by the output list only (8 bytes a token), not by a digest chain (about 70
    bytes a token more), in a live session and in a closed one kept for retries."""
    import tracemalloc
    contract = make_contract(max_new=20_000)

    def resumed(out):
        digest = chain(prefix_digest(contract.digest, PROMPT), out)[-1]
        from sdcp_fast.core.messages import Resume
        msg = SessionOpen(SID, 2, contract, PROMPT, "file:/log", resume=Resume(7, len(out), digest, "mlc://out"))
        return VerifierSession.open(msg, model_digest=MODEL, prompt=PROMPT, committed_tokens=out)

    def size(n):
        out = [t % 97 for t in range(n)]      # small ints: the list's pointers only
        tracemalloc.start()
        s = resumed(out)
        held = tracemalloc.take_snapshot().statistics("filename")
        tracemalloc.stop()
        assert s.digest == chain(prefix_digest(contract.digest, PROMPT), out)[-1]
        return sum(x.size for x in held)

    per_token = (size(10_000) - size(0)) / 10_000
    assert per_token < 12, f"{per_token:.1f} bytes a committed token"


def test_digest_after_rounds_is_the_chain_end():
    s = open_session()
    emitted = []
    for _ in range(5):
        _, record, verdict = run_round(s, tokens=(1, 2, 3), accepted=2, extra=42)
        emitted += record.emitted
        assert verdict.digest == s.digest == record.digest
    assert s.digest == chain(prefix_digest(s.contract.digest, PROMPT), emitted)[-1]
    _, _, none = run_round(s, appended=False)            # a fenced append changes nothing
    assert none is None and s.digest == chain(prefix_digest(s.contract.digest, PROMPT), emitted)[-1]
