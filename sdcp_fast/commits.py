"""Commit records on a session's commit log, typed (section 6.8): the one place that turns a
`CommitRecord` into the bytes the log stores and back, so that roles append and read records,
never CBOR. The log itself (cache/) holds records as opaque bytes; the stored encoding is the
record's deterministic CBOR, so logs written before this module stay readable.

    append = RecordAppend(log, record, epoch, expected)
    await append_records(commit_log, [append, ...], group=True) -> [length | exception]
    record_bytes(record) -> bytes             # what the log stores: record.to_cbor(), built directly
    landed(entry, append) -> bool            # the read-after-append check: it is this append
    record_of(entry) -> CommitRecord         # ProblemError when the bytes are not a record
    effective_records(entries) -> [CommitRecord]   # effective_commits, decoded
    await read_records(commit_log, log) -> [CommitRecord]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cache import Append, CommitLog, LogEntry, append_batch, append_each, effective_commits
from .core import cbor
from .core.messages import CommitRecord

# A record's deterministic CBOR (RFC 8949 4.2.1: map keys ordered by their encoding) built
# directly: the generic encoder (to_obj, a sort, a call per value and per token) cost a few
# percent of a proposal's CPU on the verifier, once per record. tests/cache/test_commits.py
# checks it equals `record.to_cbor()`; were CommitRecord's members to change, `to_cbor`
# is used instead.
_MEMBERS = ("epoch", "round", "emitted", "committed", "digest")
_KEYS = {name: cbor.dumps(name) for name in _MEMBERS}
_ORDER = tuple(sorted(_MEMBERS, key=_KEYS.__getitem__))
_DIRECT = tuple(CommitRecord.members) == _MEMBERS and _ORDER == ("epoch", "round", "digest", "emitted", "committed")
_KEY_EPOCH, _KEY_ROUND, _KEY_DIGEST, _KEY_EMITTED, _KEY_COMMITTED = (_KEYS[name] for name in _ORDER)
_SMALL = cbor.small_heads(0)   # an unsigned integer below 24 is its own head
_HEAD_32 = cbor.head(2, 32)                   # a digest's head


@dataclass(frozen=True)
class RecordAppend:
    """One conditional append of a commit record: at position `expected` of `log`, by a
    writer of `epoch`."""

    log: str
    record: CommitRecord
    epoch: int
    expected: int


def record_bytes(record: CommitRecord) -> bytes:
    """`record.to_cbor()`: the bytes the log stores (section 6.8), built directly."""
    if not _DIRECT:
        return record.to_cbor()
    epoch, round_, committed, digest = record.epoch, record.round, record.committed, record.digest
    return b"".join((
        b"\xa5",   # a map of five
        _KEY_EPOCH, _SMALL[epoch] if epoch < 24 else cbor.head(0, epoch),
        _KEY_ROUND, _SMALL[round_] if round_ < 24 else cbor.head(0, round_),
        _KEY_DIGEST, _HEAD_32 if len(digest) == 32 else cbor.head(2, len(digest)), digest,
        _KEY_EMITTED, cbor.uint_array(record.emitted),   # validated uint32s (CommitRecord's checks)
        _KEY_COMMITTED, _SMALL[committed] if committed < 24 else cbor.head(0, committed),
    ))


def _stored(append: RecordAppend) -> Append:
    return Append(append.log, record_bytes(append.record), append.epoch, append.expected)


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
    return entry.kind == "commit" and entry.epoch == append.epoch and entry.record == record_bytes(append.record)


def record_of(entry: LogEntry) -> CommitRecord:
    """The commit record of a commit entry (ProblemError when its bytes are not one)."""
    return CommitRecord.from_cbor(entry.record)


def effective_records(entries: Sequence[LogEntry]) -> list[CommitRecord]:
    """The records that count (`effective_commits`), decoded, in order."""
    return [record_of(e) for e in effective_commits(entries)]


async def read_records(commit_log: CommitLog, log: str) -> list[CommitRecord]:
    """The effective commit records of `log`, decoded."""
    return effective_records(await commit_log.read(log))
