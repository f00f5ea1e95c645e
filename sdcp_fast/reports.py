"""What verifiers and drafters tell their routers (sections 6.1 and 6.5): status reports on
a timer, and (verifiers) session events. Neither ever raises: a router that does not answer
is retried, and an instance whose reports stop is what the router's monitor is for.

    PUT  {router}/instances/{iid}/status   status -> 204   (iid: refs.encode_instance_id)
    POST {router}/events                   event  -> 204

Several routers may share the sessions of a deployment (one owns each session; another
takes it over when the owner dies): every report and every event goes to each of them, each
router on its own timer and retries, so a dead or stopped router delays no other. A router
that does not own the event's session ignores it; the status tells every router the load of
every instance, so a router taking sessions over knows where to place them at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from .core.messages import Event, Status
from .refs import encode_instance_id
from .transport import call

log = logging.getLogger("sdcp_fast.reports")


def router_targets(router_uris: Sequence[str], router_uri: str | None) -> tuple[str, ...]:
    """The routers an instance reports to: `router_uris`, or the single `router_uri`."""
    uris = tuple(router_uris) or ((router_uri,) if router_uri else ())
    return tuple(dict.fromkeys(u.rstrip("/") for u in uris))


class RouterLink:
    def __init__(self, client, router_uris: str | Sequence[str], instance_uri: str, *, timeout_s: float):
        self.client = client
        uris = [router_uris] if isinstance(router_uris, str) else list(router_uris)
        self.router_uris = [u.rstrip("/") for u in uris]
        self.instance_uri = instance_uri
        self.timeout_s = timeout_s

    async def report_status_forever(self, status: Callable[[], Status], interval_s: float) -> None:
        """PUT the instance's status to every router every `interval_s` (below its ttl_ms)
        until cancelled; one status is taken per interval and sent to all."""
        latest: list[Status | None] = [None]
        ticks = [asyncio.Event() for _ in self.router_uris]

        async def report_to(router: str, tick: asyncio.Event) -> None:
            url = f"{router}/instances/{encode_instance_id(self.instance_uri)}/status"
            while True:
                await tick.wait()
                tick.clear()
                try:
                    await call(self.client, "PUT", url, latest[0], timeout=self.timeout_s)
                except Exception as exc:
                    log.debug("status report to %s failed: %s", router, exc)

        senders = [asyncio.ensure_future(report_to(r, t)) for r, t in zip(self.router_uris, ticks, strict=True)]
        try:
            while True:
                latest[0] = status()
                for tick in ticks:
                    tick.set()     # a router still busy with the last one gets the newest next
                await asyncio.sleep(interval_s)
        finally:
            for sender in senders:
                sender.cancel()
            await asyncio.gather(*senders, return_exceptions=True)

    async def post_event(self, event: Event, attempts: int = 5) -> None:
        """POST one event to every router, each retried with backoff while it fails (events
        are idempotent: a router ignores one it has handled, or a session it does not own)."""
        await asyncio.gather(*(self._post_event(router, event, attempts) for router in self.router_uris))

    async def _post_event(self, router: str, event: Event, attempts: int) -> None:
        url = f"{router}/events"
        for attempt in range(attempts):
            try:
                reply = await call(self.client, "POST", url, event, timeout=self.timeout_s)
                if reply.status < 500:
                    return
            except Exception as exc:
                log.warning("event to %s failed (attempt %d): %s", router, attempt + 1, exc)
            await asyncio.sleep(0.2 * 2 ** attempt)
