"""The two interfaces of the cache layer (ARCHITECTURE.md) and the names of objects.

`ObjectStore` holds opaque objects named by URI with optional leases (the draft's MLC,
section 1.4). `CommitLog` is the conditional-append log of section 6.8. Every method is
async and bounded by a timeout; errors are the typed ones of `errors.py`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

EntryKind = Literal["commit", "fence"]

DEFAULT_TIMEOUT_S = 5.0


@runtime_checkable
class ObjectStore(Protocol):
    """Objects named by URI. Lease semantics, the same on every backend:

    - `put(uri, data, lease_ms=N)` stores a leased object: it is never evicted while the
      lease runs, and it is gone once the lease expires or is released.
    - `put(uri, data)` (no lease) stores a cached object that LRU eviction may drop.
    """

    async def put(self, uri: str, data: bytes | memoryview, lease_ms: int | None = None) -> None: ...
    async def get(self, uri: str) -> bytes: ...
    async def get_many(self, uris: Sequence[str]) -> list[bytes]: ...
    async def renew(self, uri: str, lease_ms: int) -> None: ...
    async def release(self, uri: str) -> None: ...
    async def delete(self, uri: str) -> None: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class LogEntry:
    position: int  # 0-based index in the log
    kind: EntryKind  # "commit" (a verifier's record) or "fence" (the router's, epoch only)
    epoch: int
    record: bytes  # opaque commit record (the core's CBOR); b"" for a fence


@runtime_checkable
class CommitLog(Protocol):
    """Conditional-append logs named by their cache-ref (section 6.8).

    - `append` succeeds only if the log is exactly `expected` records long (else `Conflict`
      with the current length) and no fence record with an epoch above `epoch` exists (else
      `Fenced`). It returns the new length; the record's position is `expected`.
    - `fence` is unconditional on position (a router fencing a partitioned verifier must not
      lose a race to it) and monotone: it appends a fence record unless the log already
      holds a fence with this epoch (idempotent retry: returns the current length), and
      raises `Fenced` if a fence with a higher epoch exists. Returns the new length.
    - `read(log, start)` returns every entry from `start`, in order (empty for a new log).

    A timed-out append may still land: `StoreTimeout` says the answer did not come in time,
    not that nothing was written (a Redis or etcd command may have run, a file write may have
    been under way). Re-read to know: the append took effect iff position `expected` holds a
    commit with the writer's epoch and record and no fence with a higher epoch precedes it
    (on a log that enforces fencing it cannot; on a `?fencing=check` log it can, and
    `fencing.check_after_append` is the test). A later append with the same `expected`
    answers `Conflict`, never overwrites it.

    One router per session is assumed (the draft's model): a fence with an epoch already in
    the log counts as that router's retry, so two routers both fencing with E+1 would each
    believe they own epoch E+1. Routers must agree on who fences a session, e.g. by owning
    disjoint sessions.
    """

    async def append(self, log: str, record: bytes, *, epoch: int, expected: int) -> int: ...
    async def fence(self, log: str, epoch: int) -> int: ...
    async def read(self, log: str, start: int = 0) -> list[LogEntry]: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class Append:
    """One conditional append of a batch (`append_batch`)."""

    log: str
    record: bytes
    epoch: int
    expected: int


async def append_batch(commit_log: CommitLog, appends: Sequence[Append]) -> list[int | Exception]:
    """Every append of a batch (distinct logs, typically one per session); each answer is the
    new length or the exception that append raised (`Fenced`, `Conflict`, `StoreTimeout`,
    ...), exactly as `append` would have. A log class with a batched path of its own
    (`FileCommitLog.append_batch`: one worker call and one sync pass; `RedisCommitLog`: one
    pipelined round trip) takes the batch whole; any other log, wrappers included (the
    method is looked up on the class, so a wrapper delegating by `__getattr__` keeps its own
    `append`), gets the appends concurrently."""
    batched = getattr(type(commit_log), "append_batch", None)
    if batched is not None:
        return await batched(commit_log, appends)
    return await append_each(commit_log, appends)


async def append_each(commit_log: CommitLog, appends: Sequence[Append]) -> list[int | Exception]:
    """`append_batch` without a batched path: distinct logs concurrently, and the appends of
    a log named more than once one after another in batch order (run concurrently, the
    second could reach the store first and be answered Conflict)."""
    answers: list[int | Exception] = [0] * len(appends)
    positions_by_log: dict[str, list[int]] = {}
    for position, one in enumerate(appends):
        positions_by_log.setdefault(one.log, []).append(position)

    async def append_in_order(positions: list[int]) -> None:
        for position in positions:
            one = appends[position]
            try:
                answers[position] = await commit_log.append(one.log, one.record, epoch=one.epoch,
                                                            expected=one.expected)
            except Exception as error:   # cancellation goes on up
                answers[position] = error

    await asyncio.gather(*(append_in_order(positions) for positions in positions_by_log.values()))
    return answers


def effective_commits(entries: Sequence[LogEntry]) -> list[LogEntry]:
    """The commit records that count: those not preceded by a fence of a higher epoch.

    On a store that enforces fencing this is every commit record. On a store that relies on
    the read-after-append check (`fencing.check_after_append`), a fenced writer's record may
    sit in the log, and its writer treated it as failed; readers (the router recovering a
    session, section 6.9) must skip it too.
    """
    return EffectiveCommits().of(entries)


class EffectiveCommits:
    """`effective_commits` over a log read a piece at a time (a reader following a log):
    `of(entries)` takes the entries after those of the previous call, in order."""

    def __init__(self) -> None:
        self.fence_epoch = 0      # the highest fence epoch seen so far

    def of(self, entries: Sequence[LogEntry]) -> list[LogEntry]:
        commits = []
        for entry in entries:
            if entry.kind == "fence":
                self.fence_epoch = max(self.fence_epoch, entry.epoch)
            elif entry.epoch >= self.fence_epoch:
                commits.append(entry)
        return commits


SCOPE_BYTES = 16
_NAME = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=:@/-]+$")


def object_uri(name: str, scope: bytes | None = None, *, base: str = "mlc:") -> str:
    """The cache-ref of object `name`, placed under the contract's KVSP `scope` if any.

    `object_uri("q/abc", scope)` -> "mlc:/scope/<32 lowercase hex>/q/abc";
    `object_uri("q/abc")` -> "mlc:/q/abc". Names are URI path characters without dot
    segments, so two scopes can never name the same object.
    """
    if scope is not None and (not isinstance(scope, bytes) or len(scope) != SCOPE_BYTES):
        raise ValueError(f"scope must be {SCOPE_BYTES} bytes, got {scope!r}")
    name = name.strip("/")
    segments = name.split("/")
    if not name or not _NAME.match(name) or any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"bad object name {name!r}")
    prefix = f"{base}/scope/{scope.hex()}/" if scope is not None else f"{base}/"
    return prefix + name


def check_lease(lease_ms: int | None) -> None:
    if lease_ms is not None and (not isinstance(lease_ms, int) or lease_ms <= 0):
        raise ValueError(f"lease_ms must be a positive int or None, got {lease_ms!r}")


MAX_EPOCH = 2**53 - 1  # exact in every backend (Redis Lua numbers are doubles)


def check_epoch(epoch: int, *, minimum: int = 0) -> None:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not minimum <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be an int in [{minimum}, 2**53), got {epoch!r}")


def check_position(expected: int) -> None:
    if not isinstance(expected, int) or isinstance(expected, bool) or expected < 0:
        raise ValueError(f"expected must be a non-negative int, got {expected!r}")
