"""The draft's read-after-append check (section 6.8) and effective_commits, on their own."""

from __future__ import annotations

from asyncio import run

import pytest

from sdcp_fast.cache import CorruptLog, Fenced, LogEntry, check_after_append, effective_commits
from sdcp_fast.cache.fencing import Checked


class ListLog:
    """A log that accepts anything (no fencing at all) and counts what it was asked to read."""

    def __init__(self, entries):
        self.entries = [LogEntry(i, kind, epoch, rec) for i, (kind, epoch, rec)
                        in enumerate(entries)]
        self.read_from: list[int] = []

    async def read(self, log, start=0):
        self.read_from.append(start)
        return self.entries[start:]


def test_a_commit_after_a_higher_fence_is_refused():
    log = ListLog([("commit", 1, b"a"), ("fence", 2, b""), ("commit", 1, b"late")])
    with pytest.raises(Fenced) as err:
        run(check_after_append(log, "L", 2, 1))
    assert err.value.fence_epoch == 2
    assert [e.record for e in effective_commits(log.entries)] == [b"a"]


def test_a_fence_after_the_record_does_not_count():
    log = ListLog([("commit", 1, b"a"), ("commit", 1, b"b"), ("fence", 2, b"")])
    assert run(check_after_append(log, "L", 1, 1)) == Checked(2, 0)
    log = ListLog([("fence", 2, b""), ("commit", 2, b"a")])  # equal epoch: allowed
    assert run(check_after_append(log, "L", 1, 2)) == Checked(2, 2)


def test_checks_resume_where_the_last_one_stopped():
    log = ListLog([("commit", 1, b"a"), ("commit", 1, b"b"), ("fence", 3, b""),
                   ("commit", 1, b"c")])
    checked = run(check_after_append(log, "L", 1, 1))
    with pytest.raises(Fenced):
        run(check_after_append(log, "L", 3, 1, checked))
    assert log.read_from == [0, 2]
    # An earlier fence remembered in `checked` still counts although it is not re-read.
    with pytest.raises(Fenced) as err:
        run(check_after_append(log, "L", 3, 1, Checked(3, 3)))
    assert err.value.fence_epoch == 3 and log.read_from[-1] == 3


def test_a_record_that_is_not_ours_is_corruption():
    log = ListLog([("commit", 1, b"a")])
    with pytest.raises(CorruptLog):
        run(check_after_append(log, "L", 1, 1))  # nothing at position 1
    with pytest.raises(CorruptLog):
        run(check_after_append(log, "L", 0, 2))  # epoch differs from the writer's
