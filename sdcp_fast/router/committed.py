"""What the router reads from a session's commit log, and hands on through the cache: the
committed tokens and records (the log is the one source of truth), and the cache object a
verifier or drafter reads them from."""

from __future__ import annotations

import asyncio

from ..commits import read_records
from ..core.messages import CommitRecord
from ..core.problems import Kind, problem
from ..refs import committed_tokens_ref, token_list_bytes
from .sessions import RouterSession


class CommittedLog:
    def __init__(self, commit_log, store, *, lease_ms: int):
        self.commit_log = commit_log
        self.store = store
        self.lease_ms = lease_ms

    async def read(self, s: RouterSession) -> tuple[list[int], list[CommitRecord]]:
        """(committed tokens, effective commit records) of the session."""
        records = await read_records(self.commit_log, s.commit_log)
        return [t for r in records for t in r.emitted], records

    async def tokens_at(self, s: RouterSession, committed: int, tokens: list[int],
                        records: list[CommitRecord]) -> tuple[list[int], list[CommitRecord]]:
        """The committed tokens up to `committed` (a verifier's answer); the log holds them
        before the verifier's state shows them, at most a read later."""
        for _ in range(50):
            if len(tokens) >= committed:
                return tokens[:committed], records
            await asyncio.sleep(0.02)
            tokens, records = await self.read(s)
        raise problem(Kind.CONFLICT, f"commit log holds {len(tokens)} tokens, verifier says {committed}")

    async def publish(self, s: RouterSession, tokens: list[int]) -> str:
        """Put the committed tokens in the cache (leased); returns their reference."""
        ref = committed_tokens_ref(s.id, s.epoch, len(tokens), s.contract.scope)
        await self.store.put(ref, token_list_bytes(tokens), lease_ms=self.lease_ms)
        return ref
