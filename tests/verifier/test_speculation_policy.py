"""The verifier's speculation policy in a running verifier (table model, real stores), with a
cost model the test controls instead of measured timings:

- a greedy session moves from drafted rounds to self-decoding when the costs say
  speculation loses, and back to a drafter when they say it pays again; its output is the
  target's greedy decoding, every token once, its rounds consecutive on the commit log;
- under rule 2, tokens self-decoded after the plan's move follow the target distribution
  (chi-square, with the test's power shown against the draft's distribution).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from sdcp_fast.commits import read_records
from sdcp_fast.core.control import SELF_DECODE
from sdcp_fast.core.messages import Action, Sampling, SessionState, Verdict
from sdcp_fast.verifier import EngineConfig
from tests.verifier.harness import Harness, contract_for, harness_test
from tests.verifier.test_rule2_distribution import chi_square_p, draft_table, target_p

AUTO = EngineConfig(speculation="auto", max_wait_ms=1.0)


class Costs:
    """A cost model switched by the test: `speculate` True is a GPU-like verifier (a pass
    costs the same for any number of tokens, drafting is quick), False a loaded CPU one
    (every token of a pass costs, drafting is slow): the plan must self-decode there."""

    def __init__(self, speculate=lambda: True):
        self.speculate = speculate

    def observe_pass(self, tokens, seconds):
        pass

    def observe_turnaround(self, draft_tokens, seconds):
        pass

    def pass_cost(self, n):
        return 0.010 if self.speculate() else 0.010 * n

    def turnaround(self, x):
        return 0.001 if self.speculate() else 1.0

    turnaround_measured = True


class PlanWay:
    """In place of the measured `WayAtLoad`: always the plan's way (tests of the plan)."""

    way = 1

    def observe(self, tokens, active):
        pass

    def chosen(self):
        return {}


def greedy(h: Harness, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(h.backend.table[seq[-1]].argmax()))
    return seq[len(prompt):]


async def until(condition, timeout=10.0):
    for _ in range(int(timeout / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


@harness_test(timeout=60, engine_config=AUTO)
async def test_a_session_moves_to_self_decoding_and_back_without_losing_a_token(h):
    prompt, max_new = [1, 2, 3], 40
    contract = contract_for(h.backend, max_new=max_new, low_rounds=1000,
                            fallback=(Action.REDUCE, Action.SWITCH, Action.SELF_DECODE), self_load=100)
    sid, r = await h.open(contract, prompt=prompt)
    machine = h.service.sessions[sid].machine
    # drafting pays until 10 tokens are committed, loses until 25, pays again after
    h.service.engine.policy.costs = Costs(lambda: not 10 <= machine.committed < 25)
    state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
    expected = greedy(h, prompt, max_new)
    actions, m_cap = [], 4
    while not machine.closed:
        context = prompt + list(machine.output_tokens)
        m = min(m_cap, max_new - len(machine.output_tokens))
        tokens = greedy(h, context, m)    # a drafter that is always right
        resp = await h.propose(sid, state, tokens)
        assert resp.status == 200, resp.body
        v = Verdict.from_cbor(resp.body)
        actions.append(v.action)
        m_cap = v.m_cap
        if v.action == Action.SELF_DECODE:   # the verifier decodes until drafting pays again
            await until(lambda: machine.state.value == "awaiting-drafter" or machine.closed)
            if machine.closed:
                break
            assert machine.committed >= 25
        state = machine.state_message()
        if v.action == Action.SELF_DECODE:   # a drafter again, from the assignment's m_init
            state = SessionState.from_cbor((await h.assign(sid, contract, state, m_init=4)).body)
            m_cap = 4
    assert Action.SELF_DECODE in actions and actions[-1] == Action.FINISH
    assert list(machine.output_tokens) == expected
    records = await read_records(h.log, machine.commit_log)
    assert [rec.round for rec in records] == list(range(1, len(records) + 1))
    assert [t for rec in records for t in rec.emitted] == expected
    plans = h.service.engine.policy.plans
    assert plans["self"] >= 1 and plans["resume"] == 1 and plans["open-self"] == 0


V = 6
N = 1500
SAMPLING = Sampling(top_k=4, seed=20261204)


@harness_test(timeout=300, table_seed=7, vocab=V, engine_config=AUTO)
async def test_tokens_self_decoded_after_the_move_follow_the_target(h):
    """Each session: prompt [0], max_new 3, one drafted token x1 ~ q(.|0) (M = 1), whose
    verdict commits two tokens and moves the session to self-decoding (the costs say so);
    the verifier decodes the third. The triples (o1, o2, o3) must follow p(o1|0) p(o2|o1)
    p(o3|o2): 216 cells, those expected below 5 pooled, p-value above 1e-4 (a false alarm
    once in 10,000 runs); the same counts against the draft's own joint distribution for o1
    (q, then p) must be rejected (p < 1e-4), which shows the test's power."""
    h.service.engine.policy.costs = Costs(lambda: False)
    contract = contract_for(h.backend, rule=2, max_new=3, sampling=SAMPLING, low_rounds=10_000,
                            fallback=(Action.REDUCE, Action.SELF_DECODE), self_load=100)
    q_table = torch.softmax(draft_table().double(), -1).float()
    sem = asyncio.Semaphore(64)

    async def one(n: int) -> tuple[int, ...]:
        async with sem:
            sid = n.to_bytes(16, "big")
            g = torch.Generator().manual_seed(n)
            _, r = await h.open(contract, prompt=(0,), sid=sid)
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            x1 = int(torch.multinomial(q_table[0].double(), 1, generator=g))
            ref = f"mlc:/q/{n}/1"
            await h.store.put(ref, q_table[0].unsqueeze(0).numpy().tobytes(), lease_ms=60_000)
            resp = await h.propose(sid, state, [x1], q_rows=ref)
            await h.store.release(ref)
            assert resp.status == 200, resp.body
            assert Verdict.from_cbor(resp.body).action == Action.SELF_DECODE
            machine = h.service.sessions[sid].machine
            await until(lambda: machine.closed, timeout=120)
            return tuple(machine.output_tokens)

    outputs = await asyncio.gather(*(one(n) for n in range(N)))
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for o1, o2, o3 in outputs:
        counts[(o1 * V + o2) * V + o3] += 1
    p = [target_p(h, a) for a in range(V)]
    joint = torch.stack([p[0][a] * p[a][b] * p[b] for a in range(V) for b in range(V)]).reshape(-1)
    assert chi_square_p(counts, joint) > 1e-4
    q0 = torch.softmax(draft_table().double(), -1)[0]
    wrong = torch.stack([q0[a] * p[a][b] * p[b] for a in range(V) for b in range(V)]).reshape(-1)
    assert chi_square_p(counts, wrong) < 1e-4


async def self_decoded_from_open(h: Harness, contract, prompt, max_new):
    """Open a session whose plan says self-decode: the open's session-state says so, and
    the verifier decodes it to the end with no drafter and no proposal."""
    sid, r = await h.open(contract, prompt=prompt)
    assert r.status == 200, r.body
    state = SessionState.from_cbor(r.body)
    assert state.state == int(Action.SELF_DECODE) and state.round == 0
    machine = h.service.sessions[sid].machine
    await until(lambda: machine.closed, timeout=30)
    assert machine.state.value == "finished"
    expected = greedy(h, prompt, max_new)
    assert list(machine.output_tokens) == expected
    records = await read_records(h.log, machine.commit_log)
    assert [rec.round for rec in records] == list(range(1, max_new + 1))   # one token a round
    assert [t for rec in records for t in rec.emitted] == expected
    return sid


@harness_test(timeout=60, engine_config=AUTO)
async def test_a_session_opened_where_drafting_loses_self_decodes_from_its_first_token(h):
    contract = contract_for(h.backend, max_new=12, self_load=100)
    h.service.engine.policy.costs = Costs(lambda: False)
    h.service.engine.policy.ways = PlanWay()   # the model's plan decides, not the measured ways
    await self_decoded_from_open(h, contract, [1, 2, 3], 12)
    assert h.service.engine.policy.plans["open-self"] == 1
    h.service.engine.policy.costs = Costs(lambda: True)   # where drafting pays: a drafter's turn
    sid, r = await h.open(contract, prompt=[2, 3])
    assert SessionState.from_cbor(r.body).state is None
    assert h.service.sessions[sid].machine.state.value == "open"
    # a contract that does not permit self-decoding: the plan's wish does not apply
    h.service.engine.policy.costs = Costs(lambda: False)
    sid, r = await h.open(contract_for(h.backend, max_new=12), prompt=[3, 1])
    assert SessionState.from_cbor(r.body).state is None


@harness_test(timeout=60, engine_config=EngineConfig(speculation="off", max_wait_ms=1.0))
async def test_with_speculation_off_every_session_self_decodes_from_its_first_token(h):
    await self_decoded_from_open(h, contract_for(h.backend, max_new=9, self_load=100), [4, 1], 9)


class Balanced(Costs):
    """Costs where drafting pays at 95% acceptance and loses at the 70% cold-start prior: a
    pass costs 10 ms plus 2 ms a token, a drafter's turnaround 30 ms (2 sessions: 143
    tokens/s self-decoded; drafting M = 8 makes about 218 at 98%, at most 92 at 70%)."""

    def pass_cost(self, n):
        return 0.010 + 0.002 * n

    def turnaround(self, x):
        return 0.030


def test_a_session_without_rounds_of_its_own_is_planned_with_every_sessions_acceptance():
    """A session just opened, or self-decoding since its open, has no acceptance of its own:
    the plan takes the acceptance of all sessions' rounds (a running mean at first, then an
    EWMA), not the 70% prior, once any round has been seen; a session's own rounds take over
    from its first, starting from that acceptance."""
    from sdcp_fast.verifier.speculation import SessionSpeculation, SpeculationPolicy

    policy = SpeculationPolicy("auto", costs=Balanced())
    policy.active = 2
    fresh = SessionSpeculation()
    assert policy.acceptance(fresh) == 0.7
    assert policy.self_decode_from_open(fresh, 8, 2)   # at 70%, drafting loses here
    seasoned = SessionSpeculation()
    for _ in range(6):
        policy.observe_round(seasoned, 8, 8)          # every token accepted, 8 of 8
    policy.observe_round(seasoned, 7, 8)              # a rejection: 7 of 8 trials
    assert seasoned.rounds == 7 and abs(policy.pooled.alpha - (6 * 8 + 7) / (7 * 8)) < 1e-9
    assert policy.acceptance(fresh) == policy.pooled.alpha > 0.95
    assert not policy.self_decode_from_open(fresh, 8, 2)   # at the pooled 98%, drafting pays
    mine = SessionSpeculation()
    pooled = policy.pooled.alpha
    policy.observe_round(mine, 0, 8)                  # rejected at once: one token tried
    assert policy.acceptance(mine) == mine.acceptance.alpha
    assert 0.7 < mine.acceptance.alpha < pooled
    for _ in range(8):
        policy.observe_round(mine, 0, 8)
    assert policy.acceptance(mine) < 0.7 < policy.pooled.alpha


def test_drafted_rounds_that_measure_slower_than_self_decoding_move_sessions_to_it():
    """The model says drafting pays (Balanced costs, 98% acceptance), but drafted rounds
    measured at this load commit 4 tokens/s a session where self-decoding commits 7: the
    plan self-decodes, at open and at a verdict, and no session resumes drafting. Measured
    at another load (over 1.5x away), or on too few rounds, the measurement does not count."""
    from sdcp_fast.verifier.speculation import (
        MIN_RATE_ROUNDS,
        SessionSpeculation,
        SpeculationPolicy,
    )

    policy = SpeculationPolicy("auto", costs=Balanced())
    policy.active = 2
    state = SessionSpeculation(rounds=1)
    state.acceptance = dataclasses.replace(state.acceptance, alpha=0.98)
    assert policy.plan(state, 8) != SELF_DECODE
    for n in range(MIN_RATE_ROUNDS):
        policy.observe_answer(False, 4, 1.0)         # drafted: 4 tokens a second
        policy.observe_answer(True, 1, 1 / 7)        # self-decoded: 7 a second
        assert policy.drafting_measured_to_lose() == (n == MIN_RATE_ROUNDS - 1)
    assert policy.plan(state, 8) == SELF_DECODE
    assert policy.self_decode_from_open(SessionSpeculation(), 8, 2)
    state.self_decoding = True
    assert not policy.resume_drafting(state, 100, 8)
    assert not policy.drafting_measured_to_lose(active=4)   # measured at 2 sessions: not at 4
    policy.active = 4
    assert policy.plan(state, 8) != SELF_DECODE


def test_a_drafted_rate_left_behind_goes_stale_and_is_measured_afresh():
    """Drafted rounds measured to lose (in passing conditions) stop counting once the
    sessions have self-decoded STALE_ROUNDS rounds a session in play since: the plan's model
    then lets a session draft again, and the drafted rate is measured anew from its next
    round (a running mean, not the old EWMA), so a drafter that now wins keeps its sessions."""
    from sdcp_fast.verifier.speculation import (
        MIN_RATE_ROUNDS,
        STALE_ROUNDS,
        SessionSpeculation,
        SpeculationPolicy,
    )

    policy = SpeculationPolicy("auto", costs=Balanced())
    policy.active = 2
    state = SessionSpeculation(rounds=1, self_decoding=True)
    state.acceptance = dataclasses.replace(state.acceptance, alpha=0.98)
    for _ in range(MIN_RATE_ROUNDS):
        policy.observe_answer(False, 2, 1.0)         # drafted, while the passes were slow: 2 a second
        policy.observe_answer(True, 1, 1 / 7)        # self-decoded: 7 a second
    assert policy.drafting_measured_to_lose()
    for _ in range(STALE_ROUNDS * 2 - 1):          # the last drafted round was followed by one
        assert policy.drafting_measured_to_lose() and not policy.resume_drafting(state, 100, 8)
        policy.observe_answer(True, 1, 1 / 7)
    assert not policy.drafting_measured_to_lose()    # stale: the model decides
    assert policy.resume_drafting(state, 100, 8)
    for _ in range(MIN_RATE_ROUNDS):
        policy.observe_answer(False, 12, 1.0)        # drafted now: 12 a second
        assert not policy.drafting_measured_to_lose()
    assert policy.drafted_rate.at(2) == 12.0         # afresh: the slow rounds are gone
    assert policy.plan(state, 8) != SELF_DECODE


def test_a_rate_measured_at_one_load_counts_again_when_that_load_comes_back():
    """Drafted rounds measured to lose at 8 sessions still count at 8 after the verifier
    has measured both ways at 64 sessions and at one, in between."""
    from sdcp_fast.verifier.speculation import MIN_RATE_ROUNDS, SpeculationPolicy

    policy = SpeculationPolicy("auto", costs=Balanced())
    for active, drafted, itself in ((8, 4, 7), (64, 9, 2), (1, 30, 15)):
        policy.active = active
        for _ in range(MIN_RATE_ROUNDS):
            policy.observe_answer(False, drafted, 1.0)
            policy.observe_answer(True, 1, 1 / itself)
        assert policy.drafting_measured_to_lose() == (itself > drafted)
    policy.active = 8
    assert policy.drafting_measured_to_lose()
    assert not policy.drafting_measured_to_lose(active=64) and not policy.drafting_measured_to_lose(active=1)


@harness_test(timeout=60, engine_config=dataclasses.replace(AUTO, first_token=True))
async def test_a_speculating_session_gets_its_first_token_from_the_prefill_then_a_drafter(h):
    """With `first_token` on, a session the plan lets speculate commits its first token at
    the open, from the prefill's row (one self-decoded round, no drafter to wait for), then
    waits for a drafter, whose rounds start at round 2 from the committed token: the output
    is the target's greedy decoding, every token once, the rounds consecutive."""
    prompt, max_new = [2, 5, 1], 20
    contract = contract_for(h.backend, max_new=max_new, low_rounds=1000, self_load=100)
    h.service.engine.policy.costs = Costs(lambda: True)   # drafting pays
    sid, r = await h.open(contract, prompt=prompt)
    assert r.status == 200, r.body
    assert SessionState.from_cbor(r.body).state == int(Action.SELF_DECODE)   # the router waits for the event
    machine = h.service.sessions[sid].machine
    await until(lambda: machine.state.value == "awaiting-drafter")
    expected = greedy(h, prompt, max_new)
    assert list(machine.output_tokens) == expected[:1] and machine.round == 1
    assert h.service.engine.policy.plans["first-token"] == 1
    state = SessionState.from_cbor((await h.assign(sid, contract, machine.state_message())).body)
    m_cap = 4
    while not machine.closed:
        context = prompt + list(machine.output_tokens)
        tokens = greedy(h, context, min(m_cap, max_new - len(machine.output_tokens)))
        resp = await h.propose(sid, state, tokens)
        assert resp.status == 200, resp.body
        m_cap = Verdict.from_cbor(resp.body).m_cap
        state = machine.state_message()
    assert list(machine.output_tokens) == expected
    records = await read_records(h.log, machine.commit_log)
    assert [rec.round for rec in records] == list(range(1, len(records) + 1))
    assert records[0].emitted == tuple(expected[:1]) and len(records) > 1
    assert [t for rec in records for t in rec.emitted] == expected
    # a contract that does not permit self-decoding: the drafter's turn from the first token
    sid, r = await h.open(contract_for(h.backend, max_new=12), prompt=[3, 1])
    assert SessionState.from_cbor(r.body).state is None
    assert h.service.sessions[sid].machine.state.value == "open"


# a CPU's pass costs over n new tokens (seconds): a few tokens cost about what one does, hundreds
# cost in proportion (the shape measured on the 2-core VM, bench/RESULTS.md issue 38)
CPU_PASSES = {1: 0.042, 2: 0.036, 6: 0.064, 8: 0.070, 48: 0.165, 64: 0.210, 384: 0.950, 2752: 5.0}


@harness_test(timeout=60, engine_config=dataclasses.replace(AUTO, first_token=True))
async def test_a_session_whose_load_grew_after_its_open_stays_self_decoding_after_its_first_token(h):
    """The open's plan let the session speculate; by its first token's commit the costs say
    drafting loses (as when a burst of opens has come in since): it stays self-decoding, no
    drafter is asked for, and its output is the target's greedy decoding, one round a token."""
    prompt, max_new = [4, 1, 3], 12
    contract = contract_for(h.backend, max_new=max_new, low_rounds=1000, self_load=100)
    policy = h.service.engine.policy
    policy.costs = Costs(lambda: policy.plans["first-token"] == 0)   # pays until the open's move
    sid, r = await h.open(contract, prompt=prompt)
    assert r.status == 200, r.body
    machine = h.service.sessions[sid].machine
    await until(lambda: machine.closed)
    assert policy.plans["first-token"] == 1 and policy.plans["self"] == 1
    assert list(machine.output_tokens) == greedy(h, prompt, max_new)
    records = await read_records(h.log, machine.commit_log)
    assert [rec.round for rec in records] == list(range(1, max_new + 1))
    assert all(len(rec.emitted) == 1 for rec in records)


def test_a_first_token_session_is_planned_again_with_the_load_at_its_first_token():
    """`resume_drafting` for a session that self-decoded its first token only: a drafter
    where the plan at the sessions now in play says drafting pays, else self-decoding on."""
    from sdcp_fast.verifier.speculation import SessionSpeculation, SpeculationPolicy

    class LoadCosts(Costs):       # drafting pays up to 4 sessions, loses beyond
        def pass_cost(self, n):
            return 0.010 if n <= 4 * 9 else 0.010 * n

        def turnaround(self, x):
            return 0.001 if x <= 4 * 8 else 1.0

    policy = SpeculationPolicy("auto", costs=LoadCosts(), first_token=True)
    for active, drafts in ((2, True), (64, False)):
        state = SessionSpeculation()
        policy.started_first_token(state)
        assert not policy.resume_drafting(state, 0, 8, active)    # its first token is still to come
        assert policy.resume_drafting(state, 1, 8, active) == drafts
        assert state.self_decoding == (not drafts) and not state.first_token_only


def test_a_session_goes_back_to_a_drafter_only_with_tokens_left_to_repay_the_move():
    """`resume_drafting` weighs what is left of the generation against the move's cost: the
    least one (the drafters' turnaround) until a move is measured, then the measured one,
    timed from the move to the session's first drafted job."""
    from sdcp_fast.verifier.speculation import SessionSpeculation, SpeculationPolicy

    policy = SpeculationPolicy("auto", costs=Costs(), min_self_tokens=1)
    policy.ways = PlanWay()

    def self_decoding():
        state = SessionSpeculation()
        policy.moved_to_self_decoding(state)
        return state

    # unmeasured: a move costs a turnaround (1 ms); a drafted token saves about 8 ms
    assert policy.move_cost() == 0.001
    assert not policy.resume_drafting(self_decoding(), 5, 4, remaining=0)
    state = self_decoding()
    assert policy.resume_drafting(state, 5, 4, remaining=1)
    assert state.moved_at is not None and not state.self_decoding
    # its first drafted job, 0.4 s after the move, times it (later jobs do not)
    policy.observe_drafted_job(state, state.moved_at + 0.4)
    policy.observe_drafted_job(state, 1e9)
    assert policy.move_s == pytest.approx(0.4) and state.moved_at is None
    # measured: 0.4 s needs about 50 tokens left
    assert not policy.resume_drafting(self_decoding(), 5, 4, remaining=20)
    assert policy.resume_drafting(self_decoding(), 5, 4, remaining=200)
    assert policy.plans["resume"] == 2


@harness_test(timeout=60, engine_config=AUTO)
async def test_a_session_near_its_end_finishes_self_decoding(h):
    """Drafting pays again at 30 of 40 tokens, but a move back (measured at 0.5 s here)
    costs more than 10 tokens save: the session finishes self-decoding, every token once."""
    prompt, max_new = [1, 2, 3], 40
    contract = contract_for(h.backend, max_new=max_new, low_rounds=1000,
                            fallback=(Action.REDUCE, Action.SWITCH, Action.SELF_DECODE), self_load=100)
    sid, r = await h.open(contract, prompt=prompt)
    machine = h.service.sessions[sid].machine
    policy = h.service.engine.policy
    policy.costs = Costs(lambda: not 10 <= machine.committed < 30)
    policy.move_s = 0.5
    state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
    actions, m_cap = [], 4
    while not machine.closed:
        context = prompt + list(machine.output_tokens)
        tokens = greedy(h, context, min(m_cap, max_new - len(machine.output_tokens)))
        resp = await h.propose(sid, state, tokens)
        assert resp.status == 200, resp.body
        v = Verdict.from_cbor(resp.body)
        actions.append(v.action)
        m_cap = v.m_cap
        if v.action == Action.SELF_DECODE:
            await until(lambda: machine.closed or machine.state.value == "awaiting-drafter")
            break
        state = machine.state_message()
    assert Action.SELF_DECODE in actions
    assert machine.closed and machine.state.value != "awaiting-drafter"
    assert list(machine.output_tokens) == greedy(h, prompt, max_new)
    records = await read_records(h.log, machine.commit_log)
    assert [rec.round for rec in records] == list(range(1, len(records) + 1))
    assert [t for rec in records for t in rec.emitted] == greedy(h, prompt, max_new)
    assert policy.plans["resume"] == 0


def test_the_pass_curve_reads_each_load_from_the_passes_measured_near_it():
    """t(n) is what was measured at n, interpolated between measured bands and extended
    beyond them without falling; with one band, the prior slope."""
    from sdcp_fast.verifier.speculation import PassCurve

    curve = PassCurve(initial=0.010, prior_slope=0.15)
    assert curve.at(7) == 0.010 and not curve.seen
    curve.observe(4, 0.050)
    assert curve.at(4) == 0.050 and curve.at(8) > 0.050 > curve.at(2)
    curve = PassCurve()
    for n, t in CPU_PASSES.items():
        for _ in range(3):
            curve.observe(n, t)
    for n, t in CPU_PASSES.items():
        assert abs(curve.at(n) - t) < 1e-12
    assert abs(curve.at(216) - (0.210 + (216 - 64) * (0.950 - 0.210) / (384 - 64))) < 1e-12
    assert curve.at(4000) > 5.0 and curve.at(3000) > 5.0
    # passes of 65-71 tokens share the band of 64, at their mean n; an EWMA over its passes
    curve.observe(70, 0.230)
    assert 0.210 < curve.at(66) < 0.230


def test_the_plan_self_decodes_under_load_and_drafts_alone_on_a_cpus_curve():
    """With the CPU's pass curve and drafters that take 60 ms a round for one session and
    0.7 s for 64, the plan drafts at one session and self-decodes at 64."""
    from sdcp_fast.verifier.speculation import SessionSpeculation, SpeculationPolicy

    policy = SpeculationPolicy("auto")
    for n, t in CPU_PASSES.items():
        policy.observe_pass(n, t, 1)
    for x, seconds in ((5, 0.060), (40, 0.180), (320, 0.700)):
        policy.costs.observe_turnaround(x, seconds)
    state = SessionSpeculation(rounds=4)
    state.acceptance = dataclasses.replace(state.acceptance, alpha=0.97)
    policy.active = 1
    assert policy.plan(state, 8) != SELF_DECODE
    policy.active = 64
    assert policy.plan(state, 8) == SELF_DECODE
    assert policy.self_decode_from_open(SessionSpeculation(), 8, 64)


def test_the_pass_curve_below_its_smallest_pass_is_no_steeper_than_the_prior():
    """Two close, noisy passes (6 tokens 110 ms, 9 tokens 170 ms) do not put a one-token pass
    near zero: below the smallest measured band the curve falls at most at the prior's slope."""
    from sdcp_fast.verifier.speculation import PassCurve

    curve = PassCurve(initial=0.010, prior_slope=0.15)
    curve.observe(6, 0.110)
    curve.observe(9, 0.170)
    prior = 0.15 * 0.110 / (1 + 0.15 * 6)
    assert abs(curve.at(1) - (0.110 - 5 * prior)) < 1e-12
    assert curve.at(1) > 0.110 / 2


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def drive_ways(ways, clock, active: int, seconds_a_token: dict[int, float], passes: int) -> list[int]:
    """Passes of one token a session; each costs what the way under way costs a token."""
    seen = []
    for _ in range(passes):
        seen.append(ways.way)
        clock.now += seconds_a_token[ways.way] * active
        ways.observe(active, active)
    return seen


def test_the_measured_ways_keep_the_one_that_commits_more_at_each_load():
    """`WayAtLoad`: blocks of both ways at a band of load, settle tokens not timed, the
    cheaper way kept, its choice per band (8 sessions: self-decoding; 3: the plan's), the
    way not chosen run again once every WAY_RECHECK blocks, and with one session in play
    the plan's way alone."""
    from sdcp_fast.verifier.speculation import (
        PLAN,
        SELF,
        WAY_BLOCK_TOKENS,
        WAY_RECHECK,
        WAY_SETTLE_TOKENS,
        WAY_WARMUP,
        WayAtLoad,
    )

    clock = FakeClock()
    ways = WayAtLoad(clock=clock)
    per_block = WAY_SETTLE_TOKENS + WAY_BLOCK_TOKENS   # passes a block with its settle, 1 token a session
    seen = drive_ways(ways, clock, 8, {PLAN: 0.030, SELF: 0.010}, 2 * WAY_WARMUP * per_block)
    assert seen[0] == PLAN and seen[per_block] == SELF     # the plan's way first, then the other
    assert ways.chosen() == {ways.band: "self"} and ways.way == SELF
    at_8 = ways.band
    seen = drive_ways(ways, clock, 3, {PLAN: 0.020, SELF: 0.050}, 2 * WAY_WARMUP * per_block)
    assert ways.chosen() == {at_8: "self", ways.band: "plan"} and ways.way == PLAN
    # one session in play: the plan's way, nothing measured
    assert drive_ways(ways, clock, 1, {PLAN: 0.020, SELF: 0.001}, 3 * per_block) == [PLAN] * 3 * per_block
    assert len(ways.choices) == 2
    seen = drive_ways(ways, clock, 8, {PLAN: 0.030, SELF: 0.010}, (WAY_RECHECK + 2) * per_block)
    assert ways.way == SELF and 0 < seen.count(PLAN) <= 2 * per_block   # one recheck block (and its settle)


def test_where_the_measured_way_is_self_decoding_every_decision_self_decodes():
    from sdcp_fast.verifier.speculation import SELF, SessionSpeculation, SpeculationPolicy

    policy = SpeculationPolicy("auto", costs=Costs(lambda: True), first_token=True)   # the model: drafting pays
    state = SessionSpeculation(rounds=3)
    assert policy.plan(state, 8) != SELF_DECODE and not policy.self_decode_from_open(state, 8, 1)
    policy.observe_committed(1, 1)
    assert not policy.all_self_decode   # one session in play: the plan's way
    policy.ways.way = SELF
    assert policy.all_self_decode
    assert policy.plan(state, 8) == SELF_DECODE and policy.self_decode_from_open(state, 8, 1)
    policy.started_first_token(state)
    assert not policy.resume_drafting(state, 1, 8, 1) and state.self_decoding
    assert not policy.resume_drafting(state, 100, 8, 1)
    policy.ways.way = 1 - SELF
    assert policy.resume_drafting(state, 100, 8, 1)
