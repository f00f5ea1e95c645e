"""Typed calls for role code on the client side: a message in, the answer's message (or its
problem document) out, so that roles never encode or parse CBOR themselves.

    reply = await call(client, "POST", url, proposal, Verdict, timeout=5.0)
    reply.ok, reply.message, reply.problem, reply.status

`client` is anything with `transport.Client.request`'s signature. A call that got no answer
raises TransportError (RequestTimeout) as `request` does. The message is encoded
deterministically, so a retried call sends the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from sdcp_fast.core.problems import Problem, ProblemError

from .http import Message

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
