"""Speculation control: the M-choice rule of section 6.2 and m_cap of section 6.5.1."""

from __future__ import annotations

import pytest

from sdcp_fast.core.control import (
    LOAD_HIGH,
    AcceptanceEstimate,
    Escalation,
    VerifyCost,
    choose_m,
    expected_tokens,
    is_low,
    next_m_cap,
)
from sdcp_fast.core.messages import Action


def test_expected_tokens_closed_form():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def brute_force(alpha, t_d, t_v, limit):
    rates = {m: expected_tokens(alpha, m) / (m * t_d + t_v) for m in range(1, limit + 1)}
    best = max(rates.values())
    return min(m for m, r in rates.items() if r >= best * (1 - 1e-12))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("t_d, t_v", [(1.0, 10.0), (1.0, 1.0), (0.1, 10.0), (5.0, 1.0)])
def test_choose_m_maximises_throughput(alpha, t_d, t_v):
    assert choose_m(alpha, t_d, t_v, 16) == brute_force(alpha, t_d, t_v, 16)


def test_choose_m_responds_to_load_and_bandwidth():
    # a loaded drafter (slower per token) or scarce cache bandwidth proposes fewer tokens
    fast = choose_m(0.8, 1.0, 20.0, 32)
    slow = choose_m(0.8, 4.0, 20.0, 32)
    assert slow < fast
    assert choose_m(1.0, 1.0, 10.0, 7) == 7    # perfect drafter: as long as allowed
    assert choose_m(0.0, 1.0, 10.0, 7) == 1
    with pytest.raises(ValueError):
        choose_m(0.5, 1, 1, 0)


def test_a_verify_cost_growing_with_m_gives_a_shorter_m():
    # SmolLM2 on this CPU (stack.md): 82 ms for 1 new token, 133 ms for 6, 162 ms for 9, i.e.
    # t_v(M) ~ 72 + 10 M ms for M + 1 new tokens; a llama.cpp draft at 13 ms a token, alpha 0.9
    flat = choose_m(0.9, 0.013, 0.082, 16)
    steep = choose_m(0.9, 0.013, lambda m: 0.072 + 0.010 * m, 16)
    assert steep < flat
    # the rule with a cost function is the same argmax, evaluated per M
    for alpha in (0.5, 0.8, 0.97):
        rates = {m: expected_tokens(alpha, m) / (m * 0.013 + 0.072 + 0.010 * m) for m in range(1, 17)}
        assert choose_m(alpha, 0.013, lambda m: 0.072 + 0.010 * m, 16) == max(rates, key=rates.get)
    # a GPU-like flat verify cost keeps the constant-cost answer
    assert choose_m(0.9, 0.013, lambda m: 0.082, 16) == flat


def test_verify_cost_learns_its_line_from_round_times():
    cost = VerifyCost(initial=0.05)
    assert cost.at(1) == cost.at(8) == 0.05                 # nothing seen: flat, the initial guess
    cost.observe(4, 0.120)
    base, slope = cost.line()                                # one M seen: the prior slope
    assert cost.at(4) == pytest.approx(0.120)
    assert slope == pytest.approx(cost.prior_slope * base)   # slope per token = prior x a 0-token pass
    for m in (2, 4, 6, 8):                                   # exact rounds on t = 0.07 + 0.0125 M
        for _ in range(20):
            cost.observe(m, 0.07 + 0.0125 * m)
    base, slope = cost.line()
    assert base == pytest.approx(0.07, abs=1e-3) and slope == pytest.approx(0.0125, abs=2e-4)
    noisy = VerifyCost()                                     # a cost that falls with M is noise
    noisy.observe(2, 0.2)
    noisy.observe(6, 0.1)
    assert noisy.line()[1] == 0.0 and noisy.at(6) == noisy.at(2)


def test_verify_cost_forgets_a_point_its_rule_no_longer_refreshes():
    # one slow first round at M = 3 (it met a burst of sessions opening), then rounds at the
    # M = 1 that point made the rule choose: the steep line would keep M at 1 for good
    stuck, forgetting = VerifyCost(), VerifyCost(forget_after=10)
    for cost in (stuck, forgetting):
        cost.observe(3, 0.170)
    for cost in (stuck, forgetting):
        for _ in range(9):
            cost.observe(1, 0.100)
    assert choose_m(0.8, 0.009, stuck.at, 8) == choose_m(0.8, 0.009, forgetting.at, 8) == 1
    for cost in (stuck, forgetting):
        cost.observe(1, 0.100)   # the tenth round since M = 3 was last seen
    assert set(forgetting.seen) == {1} and set(stuck.seen) == {1, 3}
    assert choose_m(0.8, 0.009, stuck.at, 8) == 1
    # with one M left the prior slope decides, and a longer M is proposed (and measured) again
    assert choose_m(0.8, 0.009, forgetting.at, 8) > 1
    # a point that keeps being observed is never forgotten
    both = VerifyCost(forget_after=3)
    for _ in range(20):
        both.observe(2, 0.1)
        both.observe(4, 0.12)
    assert set(both.seen) == {2, 4}


def test_low_round_definition():
    assert is_low(0, 5, 0) and not is_low(1, 5, 0)
    assert is_low(1, 4, 30) and not is_low(2, 4, 50)   # 100*2 < 50*4 is false
    assert is_low(1, 2, 51)


def test_m_cap_reduce_load_and_restore():
    assert next_m_cap(8, 16, Action.REDUCE, True, 0) == 4
    assert next_m_cap(1, 16, Action.REDUCE, True, 0) == 1
    assert next_m_cap(8, 16, Action.CONTINUE, False, LOAD_HIGH + 1) == 4
    assert next_m_cap(8, 16, Action.CONTINUE, False, 10) == 9
    assert next_m_cap(16, 16, Action.CONTINUE, False, 10) == 16
    assert next_m_cap(8, 16, Action.CONTINUE, True, 10) == 8       # low rounds do not restore


def test_acceptance_estimate():
    """accepted and tried, each an EWMA; alpha their ratio (the prior counts as `trials`)."""
    est = AcceptanceEstimate(alpha=0.5, weight=0.5, trials=2.0)
    assert est.update(4, 4).alpha == pytest.approx((0.5 * 1.0 + 0.5 * 4) / (0.5 * 2 + 0.5 * 4))  # 4 of 4 tried
    assert est.update(1, 4).alpha == pytest.approx((0.5 * 1.0 + 0.5 * 1) / (0.5 * 2 + 0.5 * 2))  # 1 of 2 tried
    assert AcceptanceEstimate(alpha=0.1234).accept_milli == 123
    # weight 1: the round alone, its maximum-likelihood alpha
    assert AcceptanceEstimate(weight=1.0).update(3, 8).alpha == pytest.approx(3 / 4)


def test_acceptance_estimate_counts_a_round_by_what_it_tried():
    """A round rejected at its first token tried one token: after long fully accepted rounds
    it moves alpha a little, where a per-round ratio would have cut it by `weight`; the M
    chosen stays long (with a verify cost that grows with M, as on a CPU)."""
    est = AcceptanceEstimate()
    for _ in range(6):
        est = est.update(7, 7)
    before = est.alpha
    after = est.update(0, 7).alpha
    assert before > 0.99 and after > 0.9
    per_round_ratio = 0.7 * before           # what an EWMA of a/(a+1) per round gives
    verify = lambda m: 0.050 + 0.007 * m     # noqa: E731
    assert choose_m(after, 0.010, verify, 8) >= 6 > choose_m(per_round_ratio, 0.010, verify, 8)


def test_escalation_policy_from_contract(vectors):
    from sdcp_fast.core.messages import Contract
    c = Contract.from_obj(vectors["contracts"][1]["contract"])
    e = Escalation.of(c)
    assert (e.low_rounds, e.low_ratio, e.fallback, e.self_load) == (1, 28, (2, 5, 1), 67)
