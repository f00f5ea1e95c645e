"""Commit records on a session's commit log, typed (section 6.8): the one place that turns a
`CommitRecord` into the bytes the log stores and back, so that roles append and read records,
never CBOR. The log itself (cache/) holds records as opaque bytes; the stored encoding is the
record's deterministic CBOR, so logs written before this module stay readable.

    append = RecordAppend(log, record, epoch, expected)
    await append_records(commit_log, [append, ...], group=True) -> [length | exception]
    landed(entry, append) -> bool            # the read-after-append check: it is this append
    record_of(entry) -> CommitRecord         # ProblemError when the bytes are not a record
    effective_records(entries) -> [CommitRecord]   # effective_commits, decoded
    await read_records(commit_log, log) -> [CommitRecord]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cache import Append, CommitLog, LogEntry, append_batch, append_each, effective_commits
from .core.messages import CommitRecord


@dataclass(frozen=True)
class RecordAppend:
    """One conditional append of a commit record: at position `expected` of `log`, by a
    writer of `epoch`."""

    log: str
    record: CommitRecord
    epoch: int
    expected: int


def _stored(append: RecordAppend) -> Append:
    return Append(append.log, append.record.to_cbor(), append.epoch, append.expected)


async def append_records(commit_log: CommitLog, appends: Sequence[RecordAppend], *,
                         group: bool = True) -> list[int | Exception]:
    """Every append of a batch (distinct logs): with `group`, through `append_batch` (group
    commit where the log has it), else each alone (`append_each`); each answer is the new
    length or the exception that append raised, as `CommitLog.append` would have."""
    batched = append_batch if group else append_each
    return await batched(commit_log, [_stored(a) for a in appends])


def landed(entry: LogEntry, append: RecordAppend) -> bool:
    """`entry` (read back at the append's position) is that append: a commit of its epoch
    holding its record."""
    return entry.kind == "commit" and entry.epoch == append.epoch and entry.record == append.record.to_cbor()


def record_of(entry: LogEntry) -> CommitRecord:
    """The commit record of a commit entry (ProblemError when its bytes are not one)."""
    return CommitRecord.from_cbor(entry.record)


def effective_records(entries: Sequence[LogEntry]) -> list[CommitRecord]:
    """The records that count (`effective_commits`), decoded, in order."""
    return [record_of(e) for e in effective_commits(entries)]


async def read_records(commit_log: CommitLog, log: str) -> list[CommitRecord]:
    """The effective commit records of `log`, decoded."""
    return effective_records(await commit_log.read(log))
