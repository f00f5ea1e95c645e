"""What verifiers and drafters tell their router (sections 6.1 and 6.5): status reports on a
timer, and (verifiers) session events. Neither ever raises: a router that does not answer
is retried, and an instance whose reports stop is what the router's monitor is for.

    PUT  {router}/instances/{iid}/status   status -> 204   (iid: refs.encode_instance_id)
    POST {router}/events                   event  -> 204
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .core.messages import Event, Status
from .refs import encode_instance_id
from .transport import call

log = logging.getLogger("sdcp_fast.reports")


class RouterLink:
    def __init__(self, client, router_uri: str, instance_uri: str, *, timeout_s: float):
        self.client = client
        self.router_uri = router_uri.rstrip("/")
        self.instance_uri = instance_uri
        self.timeout_s = timeout_s

    async def report_status_forever(self, status: Callable[[], Status], interval_s: float) -> None:
        """PUT the instance's status every `interval_s` (below its ttl_ms) until cancelled."""
        url = f"{self.router_uri}/instances/{encode_instance_id(self.instance_uri)}/status"
        while True:
            try:
                await call(self.client, "PUT", url, status(), timeout=self.timeout_s)
            except Exception as exc:
                log.debug("status report failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def post_event(self, event: Event, attempts: int = 5) -> None:
        """POST one event, retried with backoff while the router fails (events are
        idempotent: the router ignores one it has handled)."""
        url = f"{self.router_uri}/events"
        for attempt in range(attempts):
            try:
                reply = await call(self.client, "POST", url, event, timeout=self.timeout_s)
                if reply.status < 500:
                    return
            except Exception as exc:
                log.warning("event to router failed (attempt %d): %s", attempt + 1, exc)
            await asyncio.sleep(0.2 * 2 ** attempt)
