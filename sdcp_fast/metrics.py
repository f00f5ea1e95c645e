"""Prometheus metrics and health for every role, on prometheus-client.

Each role builds its series in a registry of its own (`new_registry`: also the process, GC
and platform collectors), so several roles can live in one process (the tests) without
clashing. Every labelled series is created with each of its label values at start
(`counter(..., labels={"action": ACTIONS})`), so a scraper sees zeros before the first
request instead of series that appear only once non-zero.

`StatusPage` is the plain-HTTP handler (served by `transport.asgi.serve_web`) of

    GET /metrics   the registry in the Prometheus text format
    GET /health    200 {"status": "ok", ...} once ready; 503 {"status": "starting" | reason}

Readiness is a `Health`: not ready until `ready()` says so (the model is loaded), and then
only while its checks pass (the object store and commit log answer). Check results are kept
for `cache_s` so a busy prober costs the stores one call per second at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)

from .transport.asgi import WebRequest, WebResponse

PREFIX = "sdcp_"
# seconds-long latencies a user sees (vLLM's request buckets)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# per-token gaps and per-round steps
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


def new_registry() -> CollectorRegistry:
    """A registry with the process (CPU, memory, fds), GC and platform collectors."""
    disable_created_metrics()    # no `_created` twin of every counter: noise to every chart
    registry = CollectorRegistry(auto_describe=True)
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
    return registry


def counter(registry: CollectorRegistry, name: str, doc: str,
            labels: Mapping[str, Iterable[str]] | None = None) -> Counter:
    """A counter `sdcp_<name>_total`; with `labels`, every combination exists from the start
    (one label name per counter here, which is all the roles need)."""
    names = list(labels or {})
    metric = Counter(PREFIX + name, doc, names, registry=registry)
    for name_, values in (labels or {}).items():
        for value in values:
            metric.labels(**{name_: value})
    return metric


def refusal_counter(registry: CollectorRegistry) -> Callable[[str], None]:
    """`sdcp_refusals_total{kind}`: the transport's refusals of hostile or broken clients
    (every kind of `transport.refusals.Kind` from the start); returns what counts one, for
    `transport.Refusals(on_count=...)`."""
    from .transport.refusals import Kind

    kinds = [v for k, v in vars(Kind).items() if not k.startswith("_") and isinstance(v, str)]
    metric = counter(registry, "refusals", "Refusals of the transport, by kind", labels={"kind": kinds})
    return lambda kind: metric.labels(kind=kind).inc()


def histogram(registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
    return Histogram(PREFIX + name, doc, registry=registry, buckets=tuple(buckets))


def observe_many(histogram: Histogram, observations: Iterable[tuple[float, int]]) -> None:
    """Each (amount, times) as `times` calls of `histogram.observe(amount)` would record it,
    in one update of each bucket touched and of the sum (each `observe` takes a lock and
    several calls; a batch's rounds often share a value). On a prometheus-client whose
    histogram lacks the attributes this reads, it observes one at a time."""
    try:
        total, buckets, bounds = histogram._sum, histogram._buckets, histogram._upper_bounds
    except AttributeError:
        for amount, times in observations:
            for _ in range(times):
                histogram.observe(amount)
        return
    summed, counts, last = 0.0, {}, len(bounds)
    for amount, times in observations:
        if times <= 0:
            continue
        summed += amount * times
        at = bisect_left(bounds, amount)   # the first bound >= amount: observe's bucket
        if at < last and amount == amount:   # (a NaN falls in no bucket, as with observe)
            counts[at] = counts.get(at, 0) + times
    if not counts and summed == 0.0:
        return
    histogram._raise_if_not_observable()
    total.inc(summed)
    for at, times in counts.items():
        buckets[at].inc(times)


def gauge(registry: CollectorRegistry, name: str, doc: str,
          read: Callable[[], float] | None = None) -> Gauge:
    """A gauge; with `read`, its value is taken at scrape time."""
    metric = Gauge(PREFIX + name, doc, registry=registry)
    if read is not None:
        metric.set_function(read)
    return metric


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


# ---------------------------------------------------------------------- health


Check = Callable[[], Awaitable[None]]   # raises (any exception) when the dependency does not answer


class Health:
    """Ready once `mark_ready()` was called (the model is loaded and the service built), and
    then while every check passes."""

    def __init__(self, *, timeout_s: float = 2.0, cache_s: float = 1.0):
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self.checks: dict[str, Check] = {}
        self.details: Callable[[], dict] | None = None   # extra members of the answer
        self._ready = False
        self._last: tuple[float, bool, dict] | None = None

    def add(self, name: str, check: Check) -> None:
        self.checks[name] = check

    def mark_ready(self) -> None:
        self._ready = True

    async def probe(self) -> tuple[bool, dict]:
        if not self._ready:
            return False, {"status": "starting"}
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.cache_s:
            return self._last[1], dict(self._last[2])
        failing = {}
        for name, check in self.checks.items():
            try:
                await asyncio.wait_for(check(), self.timeout_s)
            except Exception as exc:   # any failure to answer is "not ready", with why
                failing[name] = f"{type(exc).__name__}: {exc}"[:200]
        ok = not failing
        body = {"status": "ok" if ok else "unavailable"}
        if failing:
            body["failing"] = failing
        self._last = (now, ok, body)
        return ok, dict(body)


def store_check(store) -> Check:
    """The object store answers: a read of a name nobody writes (NotFound is an answer)."""
    from .cache import NotFound

    async def check() -> None:
        with contextlib.suppress(NotFound):
            await store.get("mlc:/sdcp-health-probe")
    return check


def log_check(commit_log) -> Check:
    """The commit log answers: a read of a log nobody appends to."""
    async def check() -> None:
        await commit_log.read("log/sdcp-health-probe")
    return check


class StatusPage:
    """GET /metrics and GET /health (scrapers and probers rarely speak mTLS: a port of its own)."""

    def __init__(self, registry: CollectorRegistry, health: Health):
        self.registry = registry
        self.health = health

    async def handle(self, request: WebRequest) -> WebResponse:
        answer = await self.answer(request)
        return answer or WebResponse.json(404, {"error": f"no resource {request.method} {request.path}"})

    async def answer(self, request: WebRequest) -> WebResponse | None:
        """The page's answer, or None for a path it does not serve (the front door's routes)."""
        if request.path == "/metrics" and request.method == "GET":
            return WebResponse(200, render(self.registry), CONTENT_TYPE_LATEST)
        if request.path == "/health" and request.method in ("GET", "HEAD"):
            ok, body = await self.health.probe()
            if ok and self.health.details is not None:
                body.update(self.health.details())
            return WebResponse.json(200 if ok else 503, body)
        return None
