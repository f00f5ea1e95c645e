"""Problem details (RFC 9457) for SDCP: the draft's Table 2 and the transport's generic errors.

Every refusal anywhere in sdcp-fast is one `Problem`: the core returns them, the transport
serialises them as `application/problem+json`, clients parse them back. The `type` URI ends
with the draft's suffix (`.../sdcp-stale-base`), as ../shared/spec/NOTES.md asks; a 409 stale-base answer
carries the session-state as the extension member `state`, bytes written as lowercase hex.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_BASE_URI = "urn:ietf:params:sdcp:problem:"
MAX_DETAIL = 512  # characters of a problem's detail


class Kind(Enum):
    """A problem kind: (type suffix, HTTP status, title)."""

    # Table 2 of the draft
    STALE_EPOCH = ("sdcp-stale-epoch", 409, "Epoch is not current")
    STALE_BASE = ("sdcp-stale-base", 409, "Proposal does not extend the committed prefix")
    Q_UNAVAILABLE = ("sdcp-q-unavailable", 409, "Draft probabilities required by the rule are unavailable")
    BAD_CONTRACT = ("sdcp-bad-contract", 422, "Contract invalid or not supported")
    LIMIT = ("sdcp-limit", 422, "Proposal violates m_cap or m_max")
    SESSION_CLOSED = ("sdcp-session-closed", 410, "Session has finished or failed")
    BAD_PROPOSAL = ("sdcp-bad-proposal", 422, "Proposal inconsistent with its draft distributions")
    NOT_ASSIGNED = ("sdcp-not-assigned", 403, "Drafter is not assigned to the session")
    # Generic HTTP-level problems (not in Table 2; same document format)
    BAD_REQUEST = ("bad-request", 400, "Malformed request body")
    FORBIDDEN = ("forbidden", 403, "Caller is not allowed to use this resource")
    NOT_FOUND = ("not-found", 404, "No such resource")
    METHOD_NOT_ALLOWED = ("method-not-allowed", 405, "Method not allowed on this resource")
    CONFLICT = ("conflict", 409, "Request conflicts with the resource's state")
    TOO_LARGE = ("too-large", 413, "Request body too large")
    UNSUPPORTED_MEDIA_TYPE = ("unsupported-media-type", 415, "Body must be application/sdcp+cbor")
    HEADERS_TOO_LARGE = ("headers-too-large", 431, "Request header fields too large")
    UNAVAILABLE = ("unavailable", 503, "Service temporarily unavailable")
    # An instance's session memory or count is spent: a router places the session elsewhere.
    CAPACITY = ("capacity", 503, "No room for another session here")
    # The verifier let the session go to make room; its commit log stays: resume it from there.
    SESSION_RETIRED = ("session-retired", 404, "Session was retired here; resume it from its commit log")

    @property
    def suffix(self) -> str:
        return self.value[0]

    @property
    def status(self) -> int:
        return self.value[1]

    @property
    def title(self) -> str:
        return self.value[2]

    @property
    def type_uri(self) -> str:
        return PROBLEM_BASE_URI + self.suffix

    @classmethod
    def from_type(cls, type_uri: str) -> Kind | None:
        """The kind whose suffix ends `type_uri`, or None for a type this code does not know."""
        for kind in cls:
            if type_uri == kind.suffix or type_uri.endswith((":" + kind.suffix, "/" + kind.suffix)):
                return kind
        return None


@dataclass(frozen=True)
class Problem:
    """One RFC 9457 problem document. `state` is the session-state object for stale-base answers."""

    kind: Kind
    detail: str = ""
    state: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # details may quote untrusted input: an answer never grows with what was sent
        if len(self.detail) > MAX_DETAIL:
            object.__setattr__(self, "detail", self.detail[:MAX_DETAIL - 3] + "...")

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def type(self) -> str:
        return self.kind.type_uri

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type, "title": self.kind.title, "status": self.status}
        if self.detail:
            doc["detail"] = self.detail
        if self.state is not None:
            doc["state"] = _hexify(self.state)
        for key, value in self.extra.items():
            doc.setdefault(key, _hexify(value))
        return doc

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes | str) -> Problem:
        """Parse a problem document; unknown types map to the generic kind of their status."""
        doc = json.loads(body)
        if not isinstance(doc, dict) or not isinstance(doc.get("type", ""), str):
            raise ValueError("not a problem document")
        kind = Kind.from_type(doc.get("type", ""))
        if kind is None:
            kind = _generic_for_status(int(doc.get("status", 400)))
        state = doc.get("state")
        return cls(kind, str(doc.get("detail", "")), _unhexify(state) if isinstance(state, dict) else None)


class ProblemError(Exception):
    """Raised where a function must refuse; carries the `Problem` to answer with."""

    def __init__(self, problem: Problem):
        super().__init__(f"{problem.kind.suffix}: {problem.detail}" if problem.detail else problem.kind.suffix)
        self.problem = problem


def problem(kind: Kind, detail: str = "", **kwargs: Any) -> ProblemError:
    """`raise problem(Kind.LIMIT, "M=9 > m_cap=4")` reads well at call sites."""
    return ProblemError(Problem(kind, detail, **kwargs))


def _generic_for_status(status: int) -> Kind:
    for kind in (Kind.BAD_REQUEST, Kind.FORBIDDEN, Kind.NOT_FOUND, Kind.METHOD_NOT_ALLOWED,
                 Kind.CONFLICT, Kind.TOO_LARGE, Kind.UNSUPPORTED_MEDIA_TYPE, Kind.HEADERS_TOO_LARGE,
                 Kind.UNAVAILABLE):
        if kind.status == status:
            return kind
    return Kind.UNAVAILABLE if status >= 500 else Kind.BAD_REQUEST


def _hexify(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): _hexify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hexify(v) for v in value]
    return value


_HEX_FIELDS = {"session", "digest"}


def _unhexify(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: bytes.fromhex(v) if k in _HEX_FIELDS and isinstance(v, str) else v
            for k, v in state.items()}
