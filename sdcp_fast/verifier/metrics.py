"""Counters and histograms in the Prometheus text format, served on a port of their own.

Kept deliberately small (no client library): labelled counters and fixed-bucket histograms,
rendered on demand. `MetricsPage` is the plain-HTTP handler that answers GET /metrics (the
composition root serves it with `transport.asgi.serve_web`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from ..transport.asgi import WebRequest, WebResponse

BUCKETS = {
    "batch_size": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "accepted_tokens": (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
    "forward_seconds": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
    "kernel_seconds": (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
    "queue_wait_seconds": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
    "commit_seconds": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1),
    "q_staging_seconds": (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
    "q_wait_seconds": (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
}
HELP = {
    "proposals_total": "Proposals received",
    "verdicts_total": "Rounds committed, by verdict action (self: a self-decoded token)",
    "problems_total": "Requests refused, by problem type",
    "fenced_total": "Commit-log appends refused by a newer epoch",
    "batch_size": "Jobs per forward pass",
    "accepted_tokens": "Accepted draft tokens per round",
    "forward_seconds": "Target forward pass time per batch",
    "kernel_seconds": "Verify kernel time per batch",
    "queue_wait_seconds": "Time a job waited for its batch",
    "commit_seconds": "Commit-log appends and verdicts per batch",
    "q_staging_seconds": "q rows read and copied to the device per batch",
    "q_wait_seconds": "Time the verify kernel waited for q rows after the forward pass",
}
PREFIX = "sdcp_"


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.histograms: dict[str, tuple[list[int], list[float]]] = {}

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += amount

    def observe(self, name: str, value: float) -> None:
        buckets = BUCKETS[name]
        counts, totals = self.histograms.setdefault(name, ([0] * (len(buckets) + 1), [0.0, 0.0]))
        counts[bisect.bisect_left(buckets, value)] += 1
        totals[0] += value
        totals[1] += 1

    def count(self, name: str, **labels: str) -> float:
        return self.counters[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        for name, series in sorted(self.counters.items()):
            lines += [f"# HELP {PREFIX}{name} {HELP.get(name, name)}", f"# TYPE {PREFIX}{name} counter"]
            for labels, value in sorted(series.items()):
                lines.append(f"{PREFIX}{name}{_labels(labels)} {value:g}")
        for name, (counts, (total, n)) in sorted(self.histograms.items()):
            lines += [f"# HELP {PREFIX}{name} {HELP.get(name, name)}", f"# TYPE {PREFIX}{name} histogram"]
            cumulative = 0
            for bound, count in zip((*BUCKETS[name], "+Inf"), counts, strict=True):
                cumulative += count
                lines.append(f'{PREFIX}{name}_bucket{{le="{bound}"}} {cumulative}')
            lines += [f"{PREFIX}{name}_sum {total:g}", f"{PREFIX}{name}_count {n:g}"]
        return "\n".join(lines) + "\n"


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + inner + "}"


class MetricsPage:
    """GET /metrics (scrapers rarely speak mTLS: the page has a port of its own)."""

    CONTENT_TYPE = "text/plain; version=0.0.4"

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def handle(self, request: WebRequest) -> WebResponse:
        if request.method == "GET" and request.path == "/metrics":
            return WebResponse(200, self.metrics.render().encode(), self.CONTENT_TYPE)
        return WebResponse(404, b"not found\n", self.CONTENT_TYPE)
