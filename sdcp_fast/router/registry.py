"""The router's view of its instances: the latest status of each, and when it expires.

An instance is live while its last status report is younger than the report's ttl_ms
(section 6.1: the router MUST NOT assign sessions to an instance whose status expired). It
is silent (taken for dead: its sessions move) once its status expired, or when it has not
reported at all `grace_s` after the registry started: a router that has just started (or
taken sessions over) does not fail over every session before the first reports arrive.
Instances are configured (URI, role, and for drafters the model digest); a report from an
instance the router does not know is refused by the resource, not here.

Selection keys (local policy, section 6.1):
- verifier: lowest (load + sessions opened since its report), then fewest sessions this
  router has opened there, then queue, then URI. A verifier's load counts the jobs of its
  batch, not its sessions: two idle verifiers both report 0, and the count spreads new
  sessions across them in turn where a report between two opens would otherwise send both
  to one;
- drafter: lowest (load + `session_load` x sessions assigned since its report, queue),
  then highest accept_milli, then URI. The per-assignment term spreads a burst of new
  sessions before the next report shows them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..core.messages import ROLE_DRAFTER, ROLE_VERIFIER, Status


@dataclass
class Instance:
    uri: str
    role: int
    model: bytes | None = None           # drafter: digest of its draft model
    status: Status | None = None
    expires: float = 0.0                 # monotonic seconds
    placed_since_status: int = 0         # sessions given to it since the last report
    placed: int = 0                      # sessions given to it since the router started

    def live(self, now: float) -> bool:
        return self.status is not None and now < self.expires


@dataclass
class Registry:
    instances: dict[str, Instance] = field(default_factory=dict)
    session_load: int = 5                # percent a new session is assumed to add
    grace_s: float = 0.0                 # after start, an instance not heard from is not yet silent
    started: float = field(default_factory=time.monotonic)

    def add(self, uri: str, role: int, model: bytes | None = None) -> None:
        self.instances[uri] = Instance(uri, role, model)

    def get(self, uri: str) -> Instance | None:
        return self.instances.get(uri)

    def report(self, status: Status, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        inst = self.instances[status.instance]
        inst.status = status
        inst.expires = now + status.ttl_ms / 1000
        inst.placed_since_status = 0

    def live(self, role: int, now: float | None = None) -> list[Instance]:
        now = time.monotonic() if now is None else now
        return [i for i in self.instances.values() if i.role == role and i.live(now)]

    def is_live(self, uri: str | None, now: float | None = None) -> bool:
        inst = self.instances.get(uri) if uri else None
        return inst is not None and inst.live(time.monotonic() if now is None else now)

    def silent(self, uri: str | None, now: float | None = None) -> bool:
        """Taken for dead: its status expired, or it never reported and the grace is over."""
        now = time.monotonic() if now is None else now
        inst = self.instances.get(uri) if uri else None
        if inst is None:
            return True
        if inst.status is None:
            return now - self.started > self.grace_s
        return not inst.live(now)

    def pick_verifier(self, exclude: Iterable[str] = ()) -> Instance | None:
        excluded = set(exclude)
        candidates = [i for i in self.live(ROLE_VERIFIER) if i.uri not in excluded]
        if not candidates:
            return None
        best = min(candidates, key=lambda i: (i.status.load + i.placed_since_status, i.placed,
                                              i.status.queue, i.uri))
        best.placed_since_status += 1
        best.placed += 1
        return best

    def pick_drafter(self, permitted: Iterable[bytes] | None,
                     exclude: Iterable[str] = ()) -> Instance | None:
        excluded = set(exclude)
        allowed = None if permitted is None else set(permitted)
        candidates = [i for i in self.live(ROLE_DRAFTER) if i.uri not in excluded
                      and (allowed is None or i.model in allowed)]
        if not candidates:
            return None
        best = min(candidates, key=lambda i: (
            i.status.load + self.session_load * i.placed_since_status, i.status.queue,
            -(i.status.accept_milli or 0), i.uri))
        best.placed_since_status += 1
        return best

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        out = []
        for i in self.instances.values():
            s = i.status
            out.append({
                "uri": i.uri, "role": {ROLE_DRAFTER: "drafter", ROLE_VERIFIER: "verifier"}[i.role],
                "live": i.live(now), "load": s.load if s else None, "queue": s.queue if s else None,
                "accept_milli": s.accept_milli if s else None, "cache_mbps": s.cache_mbps if s else None,
                "model": i.model.hex() if i.model else None,
            })
        return out
