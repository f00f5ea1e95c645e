"""Following a session another router owns: what this router's front door streams to a
client that reconnected here (`GET .../stream?from=n` with the stream id), and what a router
keeps streaming to its own clients for a session it lost.

The committed tokens come from the session's commit log (the one source of truth: every
token a verifier released is there, in order, and nothing else), read from where the last
read stopped every `interval_s`; the end comes from the session-table record (finish or
fail, or the owner's cancel with the output length at that moment), or from the log itself
when it shows the contract's end (max_new tokens, or a stop token). Tokens are appended to
the same `RouterSession` the streams wait on, so a stream never sees a gap or a repeat, and
once this router takes the session over (router/service.py) the same object goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..cache import CacheError, EffectiveCommits
from ..commits import record_of
from ..core.messages import Action
from ..core.problems import ProblemError
from . import stored
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router.follow")


class LogTail:
    """The committed tokens of one log, read incrementally (only the entries appended since
    the last read; `cache.EffectiveCommits` skips what a later-epoch fence refused)."""

    def __init__(self, commit_log, name: str):
        self.commit_log = commit_log
        self.name = name
        self.position = 0
        self.commits = EffectiveCommits()
        self.tokens: list[int] = []

    async def read(self) -> list[int]:
        """Every committed token so far."""
        entries = await self.commit_log.read(self.name, self.position)
        if entries:
            self.position = entries[-1].position + 1
        for entry in self.commits.of(entries):
            self.tokens.extend(record_of(entry).emitted)
        return self.tokens


def log_shows_end(s: RouterSession, tokens: list[int]) -> bool:
    """The contract ends the output here: max_new tokens, or a stop token (section 6.3)."""
    return len(tokens) >= s.contract.max_new or bool(tokens and tokens[-1] in s.contract.stop)


async def follow(s: RouterSession, commit_log, table, *, interval_s: float = 0.05,
                 record_every_s: float = 0.5, catch_up_s: float = 10.0) -> None:
    """Bring `s` up to date from the log and the table until it ends (or until cancelled:
    this router took it over). An end the record shows is taken once the log holds the
    output the owner had then (its streams must not end before their last tokens)."""
    tail = LogTail(commit_log, s.commit_log)
    key = stored.key_of(s.id)
    next_record, ending, give_up = 0.0, None, None
    while not s.done:
        try:
            tokens = await tail.read()
            if ending is not None:
                final = ending["final_tokens"]
                if final is None or len(tokens) >= final or time.monotonic() > give_up:
                    s.add_output(tokens[len(s.tokens):final])
                    stored.end(ending, s)
                    s.notify()
                    return
            elif len(tokens) > len(s.tokens):
                s.add_output(tokens[len(s.tokens):])
            if ending is None and time.monotonic() >= next_record:
                next_record = time.monotonic() + record_every_s
                record = await table.read(key)
                if record is None:          # deleted: the session ended long ago
                    s.end(finish=Action.FINISH if log_shows_end(s, tokens) else Action.FAIL)
                    s.notify()
                    return
                obj = stored.decode(record.value)
                if obj["finish"] is not None or obj["cancelled"] is not None:
                    ending, give_up = obj, time.monotonic() + catch_up_s
                    continue
            if ending is None and log_shows_end(s, tokens):
                s.end(finish=Action.FINISH)
                s.notify()
                return
        except (CacheError, ProblemError, ValueError) as exc:
            log.info("session %s: following failed for now: %s", s.id.hex(), exc)
        await asyncio.sleep(interval_s)
