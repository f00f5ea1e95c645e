"""The verifier's speculation plan (control.plan_speculation) over cost models, and how a
session applies it (VerifierSession.complete's `plan`): speculate where a round commits more
per second than self-decoding, self-decode where it does not, and never let the plan
override finish or the ladder."""

from __future__ import annotations

import pytest

from sdcp_fast.core.control import SELF_DECODE, expected_tokens, move_repaid_by, plan_speculation
from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import Action, Assignment, Contract, Proposal, SessionOpen, Status
from sdcp_fast.core.session import State, VerifierSession

ALPHA = 0.97   # the real pair's acceptance (a twin of the target)


def gpu_pass(n: int) -> float:
    """A pass costs the same for 1 or 600 tokens (memory-bound)."""
    return 0.020


def cpu_pass(n: int) -> float:
    """A pass's cost grows with every token (compute-bound): 34 ms for one, 4 ms a token more."""
    return 0.030 + 0.004 * n


def drafting(x: int) -> float:
    """The drafters' turnaround for x draft tokens in a round (7 ms a token, shared by two)."""
    return 0.002 + 0.0035 * x


def test_one_session_on_a_cpu_speculates():
    m = plan_speculation(ALPHA, 8, 1, cpu_pass, drafting)
    assert m >= 3
    rate = expected_tokens(ALPHA, m) / (drafting(m) + cpu_pass(m + 1))
    assert rate > 1.5 / cpu_pass(1)


def test_a_loaded_cpu_verifier_self_decodes():
    assert plan_speculation(ALPHA, 8, 64, cpu_pass, drafting) == SELF_DECODE


def test_a_gpu_verifier_speculates_at_any_load():
    for sessions in (1, 16, 64, 256):
        assert plan_speculation(ALPHA, 8, sessions, gpu_pass, lambda x: 0.005) >= 4


def test_poor_drafts_self_decode_even_alone():
    assert plan_speculation(0.05, 8, 1, cpu_pass, drafting) == SELF_DECODE


def test_a_steeper_pass_gives_a_shorter_m():
    flat = plan_speculation(0.8, 8, 1, lambda n: 0.030 + 0.001 * n, lambda x: 0.001)
    steep = plan_speculation(0.8, 8, 1, lambda n: 0.030 + 0.012 * n, lambda x: 0.001)
    assert steep < flat


def test_a_move_back_to_a_drafter_is_repaid_by_the_tokens_left():
    """A move costs its seconds once; each token after it saves a self-decoded token's time
    less a drafted one's, at the best M (one session on the CPU: the plan speculates)."""
    m = plan_speculation(ALPHA, 8, 1, cpu_pass, drafting)
    drafted = (drafting(m) + cpu_pass(m + 1)) / expected_tokens(ALPHA, m)   # seconds a drafted token
    gain = cpu_pass(1) - drafted
    assert gain > 0
    need = move_repaid_by(ALPHA, 8, 1, cpu_pass, drafting, move_s=0.5)
    assert need == pytest.approx(0.5 / gain)
    assert 10 < need < 100
    assert move_repaid_by(ALPHA, 8, 1, cpu_pass, drafting, move_s=1.0) == pytest.approx(2 * need)


def test_no_tokens_repay_a_move_where_drafting_does_not_win():
    assert move_repaid_by(ALPHA, 8, 64, cpu_pass, drafting, move_s=0.001) == float("inf")
    assert move_repaid_by(0.05, 8, 1, cpu_pass, drafting, move_s=0.001) == float("inf")


@pytest.mark.parametrize("speculating", [True, False])
def test_a_session_stays_where_it_is_within_the_margin(speculating):
    # self-decoding commits 5% more than the best M: inside the 10% margin either way
    best_round = drafting(1) + cpu_pass(2)
    spec_rate = expected_tokens(ALPHA, 1) / best_round

    def pass_cost(n: int) -> float:
        return 1 / (1.05 * spec_rate) if n == 1 else best_round - drafting(1) if n == 2 else 1e9

    m = plan_speculation(ALPHA, 1, 1, pass_cost, drafting, speculating=speculating)
    assert (m != SELF_DECODE) == speculating
    # 20% apart: both move
    def clear(n: int) -> float:
        return 1 / (1.2 * spec_rate) if n == 1 else best_round - drafting(1)

    assert plan_speculation(ALPHA, 1, 1, clear, drafting, speculating=speculating) == SELF_DECODE
    def worse(n: int) -> float:
        return 1.2 / spec_rate if n == 1 else best_round - drafting(1)

    assert plan_speculation(ALPHA, 1, 1, worse, drafting, speculating=speculating) == 1


# ---------------------------------------------------------------------- applied by the session

SID = bytes(16)
ROUTER_DRAFTER = "https://drafter-1.test/"


def session(**contract_overrides) -> VerifierSession:
    fields = dict(target=bytes(32), tokenizer=bytes(32), rule=1, m_max=8, max_new=100, stop=(),
                  low_rounds=2, fallback=(Action.REDUCE, Action.SELF_DECODE), self_load=60)
    fields.update(contract_overrides)
    contract = Contract(**fields)
    s = VerifierSession.open(SessionOpen(SID, 1, contract, (1, 2, 3), "log/x"), model_digest=bytes(32),
                             prompt=[1, 2, 3])
    s.assign(Assignment(SID, 1, contract, "https://v.test/", ROUTER_DRAFTER, (1, 2, 3), 0, 0,
                        prefix_digest(contract.digest, [1, 2, 3]), 4))
    return s


def round_with(s: VerifierSession, accepted: int, *, load: int = 10, plan: int | None, m: int = 4):
    p = Proposal(SID, 1, s.round + 1, ROUTER_DRAFTER, s.committed, s.digest, tuple(range(10, 10 + m)),
                 Status(ROUTER_DRAFTER, 1, 0, 0, 1000))
    job = s.check(ROUTER_DRAFTER, p)
    s.complete(job, accepted, 99, load, plan)
    return s.commit_result(True)


def test_a_plan_of_m_sets_m_cap():
    s = session()
    v = round_with(s, 4, plan=6)
    assert (v.action, v.m_cap) == (Action.CONTINUE, 6)
    v = round_with(s, 4, plan=20)   # clamped to m_max
    assert v.m_cap == 8


def test_a_self_decode_plan_moves_the_session_and_leaves_the_ladder_alone():
    s = session()
    before = s.counters
    v = round_with(s, 4, plan=SELF_DECODE)
    assert v.action == Action.SELF_DECODE and v.low == 0
    assert s.state == State.SELF_DECODING and s.counters.j == before.j


def test_self_decoding_needs_the_contract_and_the_load():
    v = round_with(session(self_load=None), 4, plan=SELF_DECODE)
    assert v.action == Action.CONTINUE
    v = round_with(session(), 4, plan=SELF_DECODE, load=61)
    assert v.action == Action.CONTINUE


def test_finish_and_the_ladder_come_first():
    s = session(max_new=5)
    assert round_with(s, 4, plan=SELF_DECODE).action == Action.FINISH
    s = session()
    round_with(s, 0, plan=None)              # a low round
    v = round_with(s, 0, plan=SELF_DECODE)   # the second: the ladder's reduce
    assert v.action == Action.REDUCE and v.m_cap == 2
