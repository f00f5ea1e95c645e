"""The read-after-append check of section 6.8, for stores that cannot enforce fencing.

A store that offers only a conditional append (position or entity tag) cannot refuse an
append from a writer with a stale epoch that read the log after the fence. The draft's
remedy: after the conditional append succeeds, read the log and treat the append as failed
if a fence record with a higher epoch precedes the writer's own record. Any backend without
atomic epoch checks calls `check_after_append` right after its conditional append (the
`redis://...?fencing=check` log does); readers then skip such records with
`api.effective_commits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import CommitLog
from .errors import CorruptLog, Fenced


@dataclass(frozen=True)
class Checked:
    """How far a writer has already checked a log: no need to read that part again."""

    upto: int = 0  # entries [0, upto) were read
    fence_epoch: int = 0  # highest fence epoch among them (0: none)


async def check_after_append(log_store: CommitLog, log: str, position: int, epoch: int,
                             checked: Checked = Checked()) -> Checked:
    """Raise `Fenced` if a fence record with an epoch above `epoch` precedes `position`.

    `position` is where the writer's own record landed (its `expected`). A fence anywhere
    before it counts, however old; `checked` (what the previous call returned for this log)
    lets a writer read only what was appended since, so a session's checks cost O(records)
    in total rather than O(records^2). Returns the new `Checked` on success.
    """
    if checked.upto > position:
        checked = Checked()
    entries = await log_store.read(log, checked.upto)
    own_index = position - checked.upto
    if len(entries) <= own_index:
        raise CorruptLog(f"{log}: own record at {position} missing after append")
    own = entries[own_index]
    if own.kind != "commit" or own.epoch != epoch:
        raise CorruptLog(f"{log}: position {position} holds {own.kind}@{own.epoch}, not ours")
    fence_epoch = max([checked.fence_epoch]
                      + [e.epoch for e in entries[:own_index] if e.kind == "fence"])
    if fence_epoch > epoch:
        raise Fenced(fence_epoch)
    return Checked(position + 1, fence_epoch)
