"""Counters and histograms in the Prometheus text format, served on a port of their own.

Kept deliberately small (no client library): labelled counters and fixed-bucket histograms,
rendered on demand. The metrics port speaks plain HTTP/1.1 and only answers GET /metrics.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import defaultdict

log = logging.getLogger("sdcp_fast.metrics")

BUCKETS = {
    "batch_size": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "accepted_tokens": (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
    "forward_seconds": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
    "kernel_seconds": (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
    "queue_wait_seconds": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
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


async def serve_metrics(metrics: Metrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics over plain HTTP/1.1 (scrapers rarely speak mTLS; the port is separate)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if head.startswith(b"GET ") and path.split(b"?")[0] == b"/metrics":
                body, status = metrics.render().encode(), b"200 OK"
            else:
                body, status = b"not found\n", b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; version=0.0.4\r\n"
                         b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=16384)
