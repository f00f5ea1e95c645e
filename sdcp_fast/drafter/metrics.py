"""The drafter's Prometheus series (prometheus-client; the page is `metrics.StatusPage`).

    sdcp_drafter_sessions                         sessions whose round loop runs here (gauge)
    sdcp_drafter_load_percent                     load as reported to the router (gauge)
    sdcp_draft_seconds                            drafting one proposal, cache writes included
    sdcp_drafter_proposals_total{outcome}         every answer to a proposal sent: "verdict",
                                                  "no_answer" (transport error, retried), or the
                                                  problem type that refused it
    sdcp_drafter_draft_tokens_total               tokens proposed in rounds that got a verdict
    sdcp_drafter_accepted_tokens_total            of those, accepted
    sdcp_drafter_draft_ahead                      drafting ahead chosen: 1 yes, 0 no (wait for each
                                                  verdict), -1 still measuring both ways (ahead.py)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from ..core.problems import Kind
from ..metrics import PREFIX, STEP_BUCKETS, counter, gauge, histogram, new_registry

OUTCOMES = ("verdict", "no_answer", *(k.suffix for k in Kind))


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else new_registry()
        self.draft_seconds = histogram(r, "draft_seconds", "Drafting one proposal, cache writes included",
                                       STEP_BUCKETS)
        self.proposals = counter(r, "drafter_proposals", "Answers to proposals sent, by outcome",
                                 labels={"outcome": OUTCOMES})
        self.draft_tokens = counter(r, "drafter_draft_tokens", "Tokens proposed in rounds with a verdict")
        self.accepted_tokens = counter(r, "drafter_accepted_tokens", "Proposed tokens the verifier accepted")

    def watch(self, *, sessions: Callable[[], float], load: Callable[[], float],
              draft_ahead: Callable[[], float] | None = None) -> None:
        gauge(self.registry, "drafter_sessions", "Sessions whose round loop runs on this drafter", sessions)
        gauge(self.registry, "drafter_load_percent", "Drafter load as reported to the router", load)
        if draft_ahead is not None:
            gauge(self.registry, "drafter_draft_ahead",
                  "Drafting ahead chosen: 1 yes, 0 no, -1 still measuring both ways", draft_ahead)

    def outcome(self, outcome: Kind | str) -> None:
        self.proposals.labels(outcome=outcome.suffix if isinstance(outcome, Kind) else outcome).inc()

    def verdict(self, m: int, accepted: int) -> None:
        self.outcome("verdict")
        self.draft_tokens.inc(m)
        self.accepted_tokens.inc(accepted)

    def value(self, sample: str, **labels: str) -> float:
        return self.registry.get_sample_value(PREFIX + sample, labels) or 0.0
