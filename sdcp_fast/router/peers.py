"""The router's typed client for the resources of verifiers and drafters (Table 1).

Each call sends one message and returns the message of the answer, or a `Refused` that
says why not: the problem kind of the answer (None when there was no answer, or one that
is not a problem document). Every call is idempotent (a retried open, assignment or policy
gets the same answer) and bounded by a timeout; URLs are built here and nowhere else.

    await peers.open_session(verifier, SessionOpen)          -> SessionState | Refused
    await peers.put_drafter(verifier, Assignment)            -> SessionState | Refused
    await peers.set_policy(verifier, Policy)                 -> SessionState | Refused
    await peers.output(verifier, session, start, timeout=)   -> Output | Refused
    await peers.assign(drafter, Assignment)                  -> None (204) | Refused
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from ..core.messages import Assignment, Output, Policy, SessionOpen, SessionState
from ..core.problems import Kind
from ..refs import encode_session_id
from ..transport import TransportError, call

log = logging.getLogger("sdcp_fast.router.peers")
M = TypeVar("M")


@dataclass(frozen=True)
class Refused:
    """A peer did not give the answer asked for."""

    kind: Kind | None      # the problem kind of the answer; None: no answer, or not a problem
    detail: str

    def __str__(self) -> str:
        return self.detail

    @property
    def lost(self) -> bool:
        """The verifier no longer serves the session: its log was fenced (stale-epoch), it
        let the session go (session-retired), or it never had it (not-found: a verifier
        restarted, or a router that took the session over found it gone); the router resumes
        it from its log."""
        return self.kind in (Kind.STALE_EPOCH, Kind.SESSION_RETIRED, Kind.NOT_FOUND)


def url(base: str, path: str) -> str:
    """A resource under an instance's base URI."""
    return base.rstrip("/") + "/" + path.lstrip("/")


class Peers:
    def __init__(self, client, *, timeout_s: float, open_timeout_s: float | None = None):
        self.client = client
        self.timeout_s = timeout_s
        # a session-open does work (the prompt's prefill, behind the verifier's batches):
        # under load it takes longer than a call that only answers, and a router that gave up
        # on it after `timeout_s` turned a busy verifier into "no verifier could open"
        self.open_timeout_s = open_timeout_s or timeout_s

    async def open_session(self, verifier: str, msg: SessionOpen) -> SessionState | Refused:
        return await self._call("POST", url(verifier, "sessions"), msg, SessionState,
                                timeout=self.open_timeout_s)

    async def put_drafter(self, verifier: str, msg: Assignment) -> SessionState | Refused:
        return await self._call("PUT", url(verifier, f"sessions/{encode_session_id(msg.session)}/drafter"),
                                msg, SessionState)

    async def set_policy(self, verifier: str, msg: Policy) -> SessionState | Refused:
        return await self._call("POST", url(verifier, f"sessions/{encode_session_id(msg.session)}/policy"),
                                msg, SessionState)

    async def output(self, verifier: str, session: bytes, start: int, *, timeout: float) -> Output | Refused:
        return await self._call("GET", url(verifier, f"sessions/{encode_session_id(session)}/output?from={start}"),
                                None, Output, timeout=timeout)

    async def assign(self, drafter: str, msg: Assignment) -> None | Refused:
        return await self._call("POST", url(drafter, "assignments"), msg, None)

    async def _call(self, method: str, target: str, msg, answer: type[M] | None, *,
                    timeout: float | None = None) -> M | None | Refused:
        try:
            reply = await call(self.client, method, target, msg, answer, timeout=timeout or self.timeout_s)
        except TransportError as exc:
            log.info("%s %s: %s", method, target, exc)
            return Refused(None, f"no answer: {exc}")
        if not reply.ok:
            if reply.problem is None and reply.status == (200 if answer else 204):
                log.warning("%s %s: %s", method, target, reply.detail)   # an undecodable answer
            return Refused(reply.kind, reply.detail)
        return reply.message
