"""The one HTTP client every role uses: HTTP/2 (ngh2) or HTTP/3 (aioquic), with mutual TLS 1.3.

Connections are kept per origin and reused (client_h2.py, client_h3.py); requests on one
connection run as concurrent streams. Every attempt, connection set-up and whole response
included, ends within `timeout` seconds (one `aio.Deadlines` per client and loop), so a
server trickling a byte at a time cannot hold a request. A failed attempt is retried (up to
`retries` times, short exponential backoff) only when that is safe: when the request
certainly never reached the server (connect failure, stream refused by a closing server),
or when the caller says it is idempotent (`idempotent=True`: proposals are idempotent per
round, section 6.9; GETs are safe).

`call(client, method, url, message, AnswerType)` is the typed form for role code: a message
in, the answer's message (or its problem document) out as a `Reply`; a retried call sends
the same bytes (deterministic encoding).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import Problem, ProblemError

from .client_base import DEFAULT_MAX_RESPONSE, ClientResponse, RequestTimeout, TransportError
from .client_h2 import H2Origins
from .http import SDCP_MEDIA_TYPE, Message, log
from .tlsconfig import TLSConfig


class Client:
    _limits: Deadlines | None = None   # the attempts' time limits, on the loop of the latest one

    def __init__(
        self,
        tls: TLSConfig,
        protocol: Literal["h2", "h3"] = "h2",
        *,
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        idle_timeout: float = 600.0,
        max_response: int = DEFAULT_MAX_RESPONSE,
    ):
        if protocol not in ("h2", "h3"):
            raise ValueError(f"protocol must be 'h2' or 'h3', not {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout
        self.retries = retries
        options = dict(connect_timeout=connect_timeout, idle_timeout=idle_timeout, max_response=max_response)
        if protocol == "h2":
            self._origins = H2Origins(tls, **options)
        else:
            from .client_h3 import H3Origins  # aioquic is the optional h3 extra

            self._origins = H3Origins(tls, **options)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        content_type: str | None = SDCP_MEDIA_TYPE,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> ClientResponse:
        """One HTTP exchange; raises TransportError (or RequestTimeout) when no response came."""
        method = method.upper()
        idempotent = idempotent or method in ("GET", "HEAD")
        limit = self.timeout if timeout is None else timeout
        for attempt in range(self.retries + 1):
            try:
                return await self._attempt(method, url, body, content_type, limit)
            except TransportError as exc:
                _drop_causes_tracebacks(exc)
                if attempt == self.retries or not (idempotent or not exc.sent):
                    raise
                log.info("retrying %s %s after: %s", method, url, exc)
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self._origins.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _attempt(self, method: str, url: str, body: bytes | None,
                       content_type: str | None, limit: float) -> ClientResponse:
        """One try, all of it within `limit` seconds. The request may have reached the server
        once its connection exists (the request says sent=False itself where it certainly did not)."""
        sent = False
        task = asyncio.current_task()
        assert task is not None, "Client requests run in a task"
        limits = self._limits
        if limits is None or limits.loop is not task.get_loop():
            limits = self._limits = Deadlines(task.get_loop())
        try:
            with limits.timeout(task, limit):
                connection, authority, path = await self._origins.open(url)
                sent = True
                return await connection.request(method, authority, path, body, content_type)
        except TimeoutError as exc:
            raise RequestTimeout(f"no complete answer to {method} {url} within {limit}s",
                                 sent=sent) from exc


def _drop_causes_tracebacks(exc: BaseException) -> None:
    """Bounded memory: the tracebacks of what caused a transport error are dropped once it
    has been caught (an exception object raised again for each request on a broken
    connection would otherwise grow a traceback per raise); its message stays."""
    seen: set[int] = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__


M = TypeVar("M")


@dataclass(frozen=True)
class Reply(Generic[M]):
    status: int
    ok: bool = False                  # the expected answer: 200 with a message, or 204
    message: M | None = None          # the decoded answer (ok with an answer type)
    problem: Problem | None = None    # the RFC 9457 document of an error answer
    detail: str = ""                  # why it is not ok, for logs

    @property
    def kind(self):
        """The problem kind of an error answer, or None."""
        return self.problem.kind if self.problem is not None else None


async def call(client, method: str, url: str, message: Message | None = None,
               answer: type[M] | None = None, *, idempotent: bool = True,
               timeout: float | None = None) -> Reply[M]:
    """One exchange: 200 + `answer` decoded when an answer type is given, else 204."""
    body = message.to_cbor() if message is not None else None
    response = await client.request(method, url, body, idempotent=idempotent, timeout=timeout)
    expected = 200 if answer is not None else 204
    if response.status != expected:
        problem = response.problem()
        detail = f"HTTP {response.status}" if problem is None else \
            (f"{problem.kind.suffix}: {problem.detail}" if problem.detail else problem.kind.suffix)
        return Reply(response.status, problem=problem, detail=detail)
    if answer is None:
        return Reply(response.status, ok=True)
    try:
        return Reply(response.status, ok=True, message=answer.from_cbor(response.body))  # type: ignore[attr-defined]
    except ProblemError as exc:   # a peer that answers garbage is as good as none
        return Reply(response.status, detail=f"bad {answer.__name__}: {exc}")
