"""Speculation control and escalation (draft sections 6.2 and 6.5) as pure functions.

`escalate` is the whole of section 6.5.2: counters c (consecutive low rounds), g
(consecutive rounds that are not low) and j (position in the fallback list). `next_m_cap`
is section 6.5.1: reduce halves m_cap, the verifier's load lowers it, and it is restored one
per round when rounds are no longer low and load permits. `choose_m` is the recommended
M-choice rule of section 6.2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .messages import Action, Contract

# m_cap policy under load (section 6.5.1 leaves the thresholds to the verifier):
# above LOAD_HIGH each round halves m_cap; at or below LOAD_RESTORE a round that is not
# low raises it by one, up to m_max. The gap between the two avoids oscillation.
LOAD_HIGH = 90
LOAD_RESTORE = 75


@dataclass(frozen=True)
class Escalation:
    """The parts of a contract that drive escalation."""

    low_rounds: int                 # R
    low_ratio: int                  # percent, 0 when absent
    fallback: tuple[Action, ...]
    self_load: int | None           # None: self_decode is never permitted

    @classmethod
    def of(cls, contract: Contract) -> Escalation:
        return cls(contract.low_rounds, contract.low_ratio_or_default, contract.fallback,
                   contract.self_load)


@dataclass(frozen=True)
class Counters:
    c: int = 0   # consecutive low rounds
    g: int = 0   # consecutive rounds that are not low
    j: int = 0   # next entry of the fallback list


def is_low(accepted: int, m: int, low_ratio: int) -> bool:
    """A round is low if 100 * a < low_ratio * M, or, when low_ratio is 0, if a == 0."""
    if low_ratio == 0:
        return accepted == 0
    return 100 * accepted < low_ratio * m


def escalate(policy: Escalation, counters: Counters, accepted: int, m: int,
             load: int) -> tuple[Counters, Action, int]:
    """One round's update: (new counters, action, low) where low is c after this round's
    update and before the reset that an escalation causes (../shared/spec/NOTES.md)."""
    c, g, j = counters.c, counters.g, counters.j
    if is_low(accepted, m, policy.low_ratio):
        c, g = c + 1, 0
    else:
        c, g = 0, g + 1
        if g >= policy.low_rounds:
            j = 0
    low = c
    action = Action.CONTINUE
    if c >= policy.low_rounds:
        action = Action.FAIL
        while j < len(policy.fallback):
            entry = policy.fallback[j]
            j += 1
            if entry == Action.SELF_DECODE and not self_decode_permitted(policy, load):
                continue
            action = entry
            break
        c = 0
    return Counters(c, g, j), action, low


def self_decode_permitted(policy: Escalation, load: int) -> bool:
    return policy.self_load is not None and load <= policy.self_load


def next_m_cap(m_cap: int, m_max: int, action: Action, low: bool, load: int) -> int:
    """The m_cap carried in a verdict (1 <= m_cap <= m_max)."""
    if action == Action.REDUCE:
        m_cap = m_cap // 2
    elif load > LOAD_HIGH:
        m_cap = m_cap // 2
    elif not low and load <= LOAD_RESTORE:
        m_cap = m_cap + 1
    return max(1, min(m_max, m_cap))


def clamp_m_init(m_init: int, m_max: int) -> int:
    return max(1, min(m_max, m_init))


def expected_tokens(alpha: float, m: int) -> float:
    """Expected tokens committed per round with M proposed and per-token acceptance alpha."""
    if alpha >= 1.0:
        return float(m + 1)
    return (1.0 - alpha ** (m + 1)) / (1.0 - alpha)


def choose_m(alpha: float, t_draft: float, t_verify: float, m_limit: int) -> int:
    """The M in 1..m_limit maximising expected_tokens(alpha, M) / (M * t_draft + t_verify)
    (section 6.2). Ties go to the smaller M: the same throughput for less draft work."""
    if m_limit < 1:
        raise ValueError("m_limit must be at least 1")
    alpha = min(1.0, max(0.0, alpha))
    best_m, best_rate = 1, -1.0
    for m in range(1, m_limit + 1):
        rate = expected_tokens(alpha, m) / (m * t_draft + t_verify)
        if rate > best_rate * (1 + 1e-12):
            best_m, best_rate = m, rate
    return best_m


@dataclass(frozen=True)
class AcceptanceEstimate:
    """The drafter's EWMA of per-token acceptance (alpha) for one session."""

    alpha: float = 0.7
    weight: float = 0.3   # weight of the newest round

    def update(self, accepted: int, m: int) -> AcceptanceEstimate:
        # a round accepting a of M tokens is a+1 Bernoulli trials when it stopped on a
        # rejection, M when all were accepted: the maximum-likelihood alpha of that round
        trials = m if accepted == m else accepted + 1
        observed = accepted / trials
        return replace(self, alpha=(1 - self.weight) * self.alpha + self.weight * observed)

    @property
    def accept_milli(self) -> int:
        return round(1000 * min(1.0, max(0.0, self.alpha)))
