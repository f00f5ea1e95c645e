"""The router's Prometheus series (prometheus-client), named as vLLM's under `sdcp_`:

    sdcp_num_requests_running                 generations placed on a verifier, not yet ended
    sdcp_num_requests_waiting                 generations waiting to be scheduled: in the
                                              admission queue, or for a verifier to open them
    sdcp_admission_waiting                    generations in the admission queue (admission.py)
    sdcp_admission_capacity                   generations admission lets run at once now
    sdcp_admission_wait_seconds               request received -> admitted (0 when at once)
    sdcp_admission_rejected_total             generations refused: the admission queue was full
    sdcp_time_to_first_token_seconds          request received -> first committed token
    sdcp_inter_token_latency_seconds          gap between committed tokens after the first
                                              burst (a burst of k tokens after a gap t counts
                                              k gaps of t / k)
    sdcp_e2e_request_latency_seconds          request received -> end
    sdcp_prompt_tokens_total, sdcp_generation_tokens_total
    sdcp_request_success_total{finished_reason}   stop | length | abort | fail
    sdcp_replacements_total{why}              sessions the router moved to a verifier:
                                              failover (verifier lost) | unasked_fail (the
                                              ladder ran out under a contract without fail)
    sdcp_router_takeovers_total               sessions taken over from a router whose lease ended
    sdcp_router_sessions_lost_total           sessions this router stopped acting for (taken
                                              over by another, or its lease ended)
    sdcp_router_sessions_followed             sessions of other routers streamed here
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from ..metrics import PREFIX, REQUEST_BUCKETS, STEP_BUCKETS, counter, gauge, histogram, new_registry

FINISHED_REASONS = ("stop", "length", "abort", "fail")
REPLACEMENTS = ("failover", "unasked_fail")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else new_registry()
        self.ttft = histogram(r, "time_to_first_token_seconds", "Time to the first committed token",
                              REQUEST_BUCKETS)
        self.itl = histogram(r, "inter_token_latency_seconds", "Time between committed tokens", STEP_BUCKETS)
        self.e2e = histogram(r, "e2e_request_latency_seconds", "Request latency, end to end", REQUEST_BUCKETS)
        self.prompt_tokens = counter(r, "prompt_tokens", "Prompt tokens of the requests")
        self.generation_tokens = counter(r, "generation_tokens", "Tokens generated (committed)")
        self.finished = counter(r, "request_success", "Requests ended, by finish reason",
                                labels={"finished_reason": FINISHED_REASONS})
        self.replacements = counter(r, "replacements", "Sessions re-placed on a verifier, by why",
                                    labels={"why": REPLACEMENTS})
        self.takeovers = counter(r, "router_takeovers", "Sessions taken over from a router whose lease ended")
        self.lost = counter(r, "router_sessions_lost", "Sessions this router stopped acting for")
        self.admission_wait = histogram(r, "admission_wait_seconds", "Time a generation waited for admission",
                                        REQUEST_BUCKETS)
        self.admission_rejected = counter(r, "admission_rejected", "Generations refused: admission queue full")

    def watch(self, *, running: Callable[[], float], waiting: Callable[[], float],
              followed: Callable[[], float] = lambda: 0, queued: Callable[[], float] = lambda: 0,
              capacity: Callable[[], float] = lambda: 0) -> None:
        gauge(self.registry, "num_requests_running", "Generations placed on a verifier", running)
        gauge(self.registry, "num_requests_waiting", "Generations waiting to be scheduled", waiting)
        gauge(self.registry, "router_sessions_followed", "Sessions of other routers streamed here", followed)
        gauge(self.registry, "admission_waiting", "Generations in the admission queue", queued)
        gauge(self.registry, "admission_capacity", "Generations admission lets run at once", capacity)

    def output(self, tokens: int, gap_s: float, first: bool, since_request_s: float) -> None:
        """`tokens` new committed tokens arrived `gap_s` after the previous ones."""
        self.generation_tokens.inc(tokens)
        if first:            # the first burst's wait is the time to first token
            self.ttft.observe(since_request_s)
            return
        for _ in range(tokens):
            self.itl.observe(gap_s / tokens)

    def value(self, sample: str, **labels: str) -> float:
        return self.registry.get_sample_value(PREFIX + sample, labels) or 0.0
