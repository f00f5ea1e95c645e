"""GET /health: 503 until the instance is ready (model loaded), then 200 only while its
store and commit log answer; a store that stops answering turns it back to 503."""

from __future__ import annotations

import asyncio

from sdcp_fast.metrics import Health, StatusPage, new_registry
from sdcp_fast.transport.asgi import WebRequest


def get(page: StatusPage, path: str):
    return asyncio.run(page.handle(WebRequest("GET", path, {}, {}, b"")))


def test_health_follows_readiness_and_the_stores():
    answers = {"store": None}

    async def store():
        if answers["store"] is not None:
            raise answers["store"]

    health = Health(cache_s=0)
    health.add("store", store)
    page = StatusPage(new_registry(), health)
    r = get(page, "/health")
    assert (r.status, r.body) == (503, b'{"status":"starting"}')
    health.mark_ready()
    assert get(page, "/health").status == 200
    answers["store"] = ConnectionError("redis down")
    r = get(page, "/health")
    assert r.status == 503 and b"redis down" in r.body
    assert get(page, "/nope").status == 404
    assert get(page, "/metrics").body.startswith(b"# HELP")
