"""Speculation control and escalation (draft sections 6.2 and 6.5) as pure functions.

`escalate` is the whole of section 6.5.2: counters c (consecutive low rounds), g
(consecutive rounds that are not low) and j (position in the fallback list). `next_m_cap`
is section 6.5.1: reduce halves m_cap, the verifier's load lowers it, and it is restored one
per round when rounds are no longer low and load permits. `choose_m` is the recommended
M-choice rule of section 6.2. `plan_speculation` is the verifier's side of the same rule:
from its measured pass costs and the drafters' measured turnaround, the m_cap that commits
the most, or self-decoding when no M does better than the verifier decoding by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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


def choose_m(alpha: float, t_draft: float, t_verify: float | Callable[[int], float], m_limit: int) -> int:
    """The M in 1..m_limit maximising expected_tokens(alpha, M) / (M * t_draft + t_verify(M))
    (section 6.2). `t_verify` is the round's verify cost: a number when it does not depend
    on M (a GPU verifier, nearly), or a function of M (a CPU verifier, whose pass over M + 1
    new tokens costs up to twice one token's: `VerifyCost.at`), so a steeper verify cost
    gives a shorter M. Ties go to the smaller M: the same throughput for less draft work."""
    if m_limit < 1:
        raise ValueError("m_limit must be at least 1")
    alpha = min(1.0, max(0.0, alpha))
    cost = t_verify if callable(t_verify) else (lambda m: t_verify)
    best_m, best_rate = 1, -1.0
    for m in range(1, m_limit + 1):
        rate = expected_tokens(alpha, m) / (m * t_draft + cost(m))
        if rate > best_rate * (1 + 1e-12):
            best_m, best_rate = m, rate
    return best_m


SELF_DECODE = 0   # plan_speculation's answer when no M pays: the verifier decodes itself


def size_band(n: int, exact: int = 16) -> int:
    """The band a size falls in: `n` itself up to `exact`, else `n` with all but its four
    leading bits cleared (17 -> 16, 100 -> 96, 1000 -> 960): bands at most an eighth wide,
    so that a table kept per size stays small whatever sizes come."""
    if n <= exact:
        return n
    low = n.bit_length() - 4
    return n >> low << low


def plan_speculation(alpha: float, m_limit: int, sessions: int, pass_cost: Callable[[int], float],
                     draft_gap: Callable[[int], float], *, speculating: bool = True,
                     margin: float = 0.1) -> int:
    """The verifier's choice for a session among its `sessions` active ones: the M in
    1..m_limit that maximises committed tokens per second, or SELF_DECODE (0) when the
    verifier decoding them itself commits more.

    With every session proposing M, one round is the drafters' work for sessions x M tokens
    (`draft_gap(x)`: from a verdict to the next proposal, measured) followed by one pass over
    sessions x (M + 1) tokens (`pass_cost(n)`, measured), and commits expected_tokens(alpha,
    M) a session. Self-decoded, every pass over `sessions` tokens commits one a session.
    Comparing whole rounds of all sessions, not one session at the margin, matters: one
    session that alone stopped speculating would still wait for the others' long pass, so
    at the margin speculation always looks better, even where all of them self-decoding
    commits more (a CPU verifier under load, whose pass cost grows with every token).

    `speculating`: what the session does now; it changes only for a rate better by more than
    `margin`, so that measurement noise does not move sessions to and fro (each move back
    to drafting costs the drafter a catch-up prefill)."""
    sessions = max(1, sessions)
    self_rate = sessions / max(1e-9, pass_cost(sessions))
    best_m, best_rate = _best_drafted_round(alpha, m_limit, sessions, pass_cost, draft_gap)
    if speculating:
        return SELF_DECODE if self_rate > best_rate * (1 + margin) else best_m
    return best_m if best_rate > self_rate * (1 + margin) else SELF_DECODE


def _best_drafted_round(alpha: float, m_limit: int, sessions: int, pass_cost: Callable[[int], float],
                        draft_gap: Callable[[int], float]) -> tuple[int, float]:
    """(M, committed tokens per second of all `sessions`) of the best drafted round."""
    if m_limit < 1:
        raise ValueError("m_limit must be at least 1")
    alpha = min(1.0, max(0.0, alpha))
    best_m, best_rate = 1, -1.0
    for m in range(1, m_limit + 1):
        round_s = draft_gap(sessions * m) + pass_cost(sessions * (m + 1))
        rate = sessions * expected_tokens(alpha, m) / max(1e-9, round_s)
        if rate > best_rate * (1 + 1e-12):
            best_m, best_rate = m, rate
    return best_m, best_rate


def move_repaid_by(alpha: float, m_limit: int, sessions: int, pass_cost: Callable[[int], float],
                   draft_gap: Callable[[int], float], move_s: float) -> float:
    """The fewest tokens a self-decoding session must still have to commit for its move back
    to a drafter to pay: inf where the best drafted round (as `plan_speculation` models it)
    commits a session's tokens no sooner than self-decoding does.

    A move costs `move_s` seconds before the session's first drafted job reaches the
    verifier (the drafter's catch-up prefill of everything committed, its first draft), in
    which the session commits nothing; each token after it saves the difference between a
    self-decoded token's time (one pass over `sessions` tokens) and a drafted one's (a round,
    its pass included, over the tokens it commits). A session with fewer tokens left than this would finish
    sooner self-decoding: the last tokens of a generation are never worth a drafter's
    catch-up."""
    sessions = max(1, sessions)
    _, drafted_rate = _best_drafted_round(alpha, m_limit, sessions, pass_cost, draft_gap)
    gain = pass_cost(sessions) - sessions / max(1e-9, drafted_rate)   # seconds a token saves
    return max(0.0, move_s) / gain if gain > 0 else math.inf


@dataclass
class VerifyCost:
    """The verify cost of a round as a function of M, t_v(M) = base + slope * M, learned from
    verdict timing (proposal sent -> verdict received, seconds).

    Each M seen keeps an EWMA of its round times; the line goes through them by least
    squares weighted by how often each M was seen (slope clamped at >= 0: a verify pass
    never gets cheaper with more tokens). With one M seen so far the slope is `prior_slope`
    times that M's time per round for each token: on SmolLM2-135M on a CPU a pass over 6
    new tokens cost 1.6-2.2x a one-token step (bench/RESULTS.md, issue 13), i.e. 0.12-0.24
    of a step per extra token; on a GPU the measured line soon replaces the prior with a
    near-flat one. Before any verdict, `initial` seconds flat.

    `forget_after`: a point not observed again within that many observations (of any M)
    leaves the line. A rule that picks M from this line proposes only the M it picks, so a
    point of another M is never refreshed: one slow round at M = 3 (a round that met a burst
    of sessions opening, say) would otherwise keep the slope steep and the choice at M = 1
    for good. Once the stale point is gone, the remaining points (or the prior, with one M
    left) decide, and the M they pick is measured afresh."""

    initial: float = 0.010
    weight: float = 0.3
    prior_slope: float = 0.15
    max_rounds: float = float("inf")   # cap on a point's weight in the line: a smaller cap lets
                                       # points seen lately count as much as old ones
    forget_after: float = float("inf")
    seen: dict[int, list[float]] = field(default_factory=dict)   # M -> [EWMA seconds, rounds]
    last_seen: dict[int, int] = field(default_factory=dict)      # M -> observation number
    observations: int = 0

    def observe(self, m: int, seconds: float) -> None:
        self.observations += 1
        self.last_seen[m] = self.observations
        entry = self.seen.get(m)
        if entry is None:
            self.seen[m] = [seconds, 1.0]
        else:
            entry[0] += self.weight * (seconds - entry[0])
            entry[1] = min(self.max_rounds, entry[1] + 1.0)
        for stale in [k for k, n in self.last_seen.items() if self.observations - n >= self.forget_after]:
            del self.seen[stale], self.last_seen[stale]

    def line(self) -> tuple[float, float]:
        """(base, slope) of t_v(M) = base + slope * M."""
        if not self.seen:
            return self.initial, 0.0
        if len(self.seen) == 1:
            ((m, (t, _)),) = self.seen.items()
            slope = self.prior_slope * t / (1 + self.prior_slope * m)
            return t - slope * m, slope
        total = sum(w for _, w in self.seen.values())
        mean_m = sum(m * w for m, (_, w) in self.seen.items()) / total
        mean_t = sum(t * w for t, w in self.seen.values()) / total
        var = sum(w * (m - mean_m) ** 2 for m, (_, w) in self.seen.items())
        cov = sum(w * (m - mean_m) * (t - mean_t) for m, (t, w) in self.seen.items())
        slope = max(0.0, cov / var)
        return mean_t - slope * mean_m, slope

    def at(self, m: int) -> float:
        base, slope = self.line()
        return max(1e-6, base + slope * m)



@dataclass(frozen=True)
class AcceptanceEstimate:
    """Per-token acceptance (alpha) of one session's rounds, or of all sessions': the ratio
    of two EWMAs, tokens accepted and tokens tried, a round accepting a of M having tried
    a + 1 when it stopped on a rejection and M when all were accepted. That is the
    maximum-likelihood alpha of the recent rounds with each round counted by what it tried.
    An EWMA of each round's own ratio gives a round that tried one token (rejected at once)
    as much say as one that tried eight: every early rejection cut alpha by `weight` of its
    value, and the short M that followed stayed short through the easy stretch after it,
    since a round of one or two tokens accepted raises it by little. `alpha` is the prior,
    counted as `trials` tokens tried until rounds replace it."""

    alpha: float = 0.7
    weight: float = 0.3   # weight of the newest round
    trials: float = 1.0   # the EWMA of tokens tried a round (the prior's weight at first)

    def update(self, accepted: int, m: int) -> AcceptanceEstimate:
        tried = m if accepted == m else accepted + 1
        trials = (1 - self.weight) * self.trials + self.weight * tried
        accepted_ewma = (1 - self.weight) * self.alpha * self.trials + self.weight * accepted
        return replace(self, alpha=accepted_ewma / trials, trials=trials)

    @property
    def accept_milli(self) -> int:
        return round(1000 * min(1.0, max(0.0, self.alpha)))
