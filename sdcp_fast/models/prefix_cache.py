"""What a K/V-caching backend knows about each session, and what a `score` must compute.

Shared by the built-in backend (tiny.py, K/V in one buffer per session) and the Hugging Face
backend (hf.py, K/V in the pages of one pool, or a transformers `DynamicCache` per session);
each keeps its K/V its own way and subclasses `CachedSession` to drop K/V in `truncate`.

Per session:
  * `committed`: the committed sequence C (prompt + committed output);
  * `cached`: the tokens whose K/V the session holds, positions 0..len-1. A prefix of C,
    possibly extended by the last scored proposal (speculative positions);
  * `rows`: next-token logits after cached positions rows_start..len(cached)-1, kept only for
    positions >= len(C) - 1, so a drafter that scores a growing proposal step by step gets
    the earlier rows back without recomputing them (at most len(proposal) + 1 rows of V).

`plan` finds the longest prefix of C + x the session already holds (K/V, and rows when the
first requested row is among the kept ones) and so the first position to compute; after the
backend's forward over the plans' `new_tokens`, `collect_rows` records what was computed
and returns the requested rows [sum(len(x_b) + 1), V] in order.

`CachingBackend` is the session half of such a backend (open with prefill, commit, score's
steps); a backend adds its K/V storage through three hooks: `_new_session(prompt)`,
`_reserve(plans)` (raise KVCapacityError before any change) and `_compute(plans)` (one
forward over the plans' new tokens, storing their K/V; rows keyed by id(plan)).

Prompts that begin alike (a deployment's system prompt) are not computed again: the K/V at
a position depends only on the tokens up to it, so a session that opens copies the K/V of
its common prefix with a session that holds one (a fourth hook, `_copy_prefix`; a backend
without it computes every prompt whole), and its prefill computes the rest. The session
copied from is, among those whose first `PREFIX_KEY` tokens are the prompt's, the one
holding the most positions: one lookup per prompt, whatever the number of sessions (a
shorter common prefix is computed again; a chat's earlier turns are found when their
session is that one). Among sessions opening together, with no such session yet, the first
of those that begin alike is prefilled alone first when the others would copy more tokens
from it than its own prompt holds (what the separate pass costs, in rows). A simpler form
of vLLM's automatic prefix caching and SGLang's radix cache: kept to the sessions the
backend holds (no K/V is kept for sessions released), and made of copies, not shared pages
(a session's K/V stays its own: release, truncation and export need no reference counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import (
    ModelError,
    UnknownSession,
    check_distinct_sessions,
    check_length,
    check_new_session,
    check_tokens,
    common_prefix_length,
    token_list_bytes,
)

MAX_ROWS = 65  # logits rows kept for the last proposal: at most m_max (64) + 1
PREFIX_KEY = 16  # sessions are found for a prompt by their first this many tokens (module docstring)


@dataclass(eq=False)
class CachedSession:
    committed: list[int]
    cached: list[int] = field(default_factory=list)
    rows_start: int = 0
    rows: torch.Tensor | None = None  # [len(cached) - rows_start, V] fp32

    def truncate(self, n: int) -> None:
        """Forget cached positions >= n (their K/V and logits rows). Subclasses drop K/V."""
        if n >= len(self.cached):
            return
        del self.cached[n:]
        if self.rows is not None:
            self.rows = self.rows[: max(0, n - self.rows_start)]

    def drop_rows_before(self, pos: int) -> None:
        if self.rows is None or pos <= self.rows_start:
            return
        self.rows = self.rows[pos - self.rows_start :]
        self.rows_start = pos

    def commit(self, new_committed: list[int]) -> None:
        """C := new_committed (already checked); K/V and rows that contradict it go."""
        h = common_prefix_length(self.cached, new_committed)
        if h < min(len(self.cached), len(new_committed)):
            self.truncate(h)  # rejected positions: their K/V contradicts the committed sequence
        self.committed = new_committed
        self.drop_rows_before(len(new_committed) - 1)
        if self.rows is not None and self.rows_start + len(self.rows) <= len(new_committed) - 1:
            self.rows, self.rows_start = None, len(self.cached)

    def rows_held(self) -> bool:
        """Whether the row after the committed sequence is kept (a prefill has run)."""
        return self.rows is not None and self.rows_start <= len(self.committed) - 1 < self.rows_start + len(self.rows)

    def committed_kv_tokens(self) -> int:
        """How many leading committed tokens the cached K/V covers (what an export carries)."""
        return common_prefix_length(self.cached, self.committed)


@dataclass(frozen=True, eq=False)
class Plan:
    session: CachedSession
    full: list[int]  # C + x
    first_row: int  # position of the first requested row: len(C) - 1
    start: int  # first position to compute (cached K/V kept below it)
    reuse_rows: bool  # whether rows for positions first_row..start-1 come from the cache

    @property
    def new_tokens(self) -> list[int]:
        return self.full[self.start :]

    @property
    def first_kept_row(self) -> int:
        """Index into the computed rows of the first one the score returns or keeps."""
        return max(0, self.first_row - self.start)


def plan(s: CachedSession, x: list[int]) -> Plan:
    full = s.committed + x
    first_row = len(s.committed) - 1
    h = common_prefix_length(s.cached, full)
    rows_end = s.rows_start + (len(s.rows) if s.rows is not None else 0)
    rows_end = min(rows_end, h)
    if s.rows is not None and s.rows_start <= first_row < rows_end:
        # rows for first_row..rows_end-1 are cached; compute from rows_end on
        return Plan(s, full, first_row, rows_end, True)
    return Plan(s, full, first_row, min(h, first_row), False)


def collect_rows(
    plans: Sequence[Plan], computed: dict[int, torch.Tensor], vocab_size: int, device=None
) -> torch.Tensor:
    """`computed[id(plan)]`: fp32 rows for positions max(start, first_row)..len(full)-1 of
    each plan that had new tokens (its K/V is already stored; the rows may be views of the
    pass's logits). Updates every session and returns the requested rows of all plans."""
    out = []
    for p in plans:
        s = p.session
        new_rows = computed.get(id(p))
        if new_rows is not None:
            s.cached.extend(p.new_tokens)
        if p.reuse_rows:
            s.drop_rows_before(p.first_row)
            old = s.rows if s.rows is not None else torch.empty(0, vocab_size, device=device,
                                                                dtype=new_rows.dtype if new_rows is not None else None)
            s.rows = old if new_rows is None else torch.cat([old, new_rows])
        else:  # computed from p.start <= first_row; rows from first_row on
            s.rows_start = p.first_row
            # a copy: kept rows must not pin a whole pass's logits in memory
            s.rows = new_rows.clone()
        out.append(s.rows[: len(p.full) - p.first_row])
    return torch.cat(out)


class CachingBackend:
    """Mixin: `open`, `commit`, `committed`, `cached_tokens`, `sessions` and `score` over
    `self._sessions: dict[bytes, CachedSession]`. The host sets `vocab_size`, `max_seq_len`
    (None: no cap) and implements the hooks below."""

    vocab_size: int
    max_seq_len: int | None = None
    rows_device = None  # where kept rows live (the model's device); None: the CPU
    rows_dtype = torch.float32  # the dtype of the rows score returns and keeps
    _sessions: dict[bytes, CachedSession]

    def _new_session(self, prompt: list[int]) -> CachedSession:
        raise NotImplementedError

    def _reserve(self, plans: list[Plan]) -> None:
        """Raise KVCapacityError if the plans' K/V would not fit; change nothing."""
        raise NotImplementedError

    def _compute(self, plans: list[Plan]) -> dict[int, torch.Tensor]:
        """Store the K/V of every plan's new tokens; fp32 rows from each plan's first kept
        row (Plan.first_kept_row) on, keyed by id(plan). On failure the sessions' cached
        tokens must still describe their K/V."""
        raise NotImplementedError

    def _copy_prefix(self, source: CachedSession, target: CachedSession, n: int) -> None:
        """Give `target` (a new session holding nothing) the K/V of `source`'s first n cached
        positions, as its own (only where `copies_prefixes`). May raise KVCapacityError,
        changing nothing."""
        raise NotImplementedError

    copies_prefixes = False    # whether the backend has `_copy_prefix` (else prompts are computed whole)
    prefix_tokens_copied = 0   # prompt positions whose K/V a session opened with by copy

    def open(self, session: bytes, prompt: Sequence[int]) -> None:
        self._sessions[session] = self._new_session(check_new_session(self, session, prompt))
        try:
            self._share_prefixes([session])
            self.score([(session, [])])  # prefill; keeps the row after the prompt
        except BaseException:
            self.release(session)
            raise

    def _share_prefixes(self, opening: list[bytes]) -> None:
        """Copy into each session of `opening` (new, holding nothing) the K/V of its common
        prefix with the session found for it, up to its prompt's last token (whose row the
        prefill returns); first prefill alone those that others opening with them would copy
        from (module docstring)."""
        if not self.copies_prefixes:
            return
        new = {sid: self._sessions[sid] for sid in opening}
        held: dict[tuple[int, ...], CachedSession] = {}   # first PREFIX_KEY tokens -> the longest holder
        for sid, s in self._sessions.items():
            if sid not in new and len(s.cached) >= PREFIX_KEY:
                key = tuple(s.cached[:PREFIX_KEY])
                if key not in held or len(held[key].cached) < len(s.cached):
                    held[key] = s
        alike: dict[tuple[int, ...], list[bytes]] = {}
        for sid, s in new.items():
            if len(s.committed) > PREFIX_KEY:
                alike.setdefault(tuple(s.committed[:PREFIX_KEY]), []).append(sid)
        for key, sids in alike.items():
            source = held.get(key)
            if source is None and len(sids) > 1:
                first = new[sids[0]]
                copied = sum(min(common_prefix_length(first.committed, new[o].committed), len(new[o].committed) - 1)
                             for o in sids[1:])
                if copied >= len(first.committed):
                    self.score([(sids[0], [])])   # alone: the others copy from it
                    source, sids = first, sids[1:]
            if source is None:
                continue
            for sid in sids:
                target = new[sid]
                n = min(common_prefix_length(source.cached, target.committed), len(target.committed) - 1)
                if n >= PREFIX_KEY:
                    self._copy_prefix(source, target, n)
                    self.prefix_tokens_copied += n

    def open_many(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> list[ModelError | None]:
        """`open` for several sessions, their prefills in one packed pass (chunked like any
        pass by the backend; before it, alone, a prompt that others copy a prefix from:
        `_share_prefixes`). Per item: None, or the ModelError that refused it; one
        session's refusal never fails the others (a refused pass is retried one by one)."""
        errors: list[ModelError | None] = [None] * len(items)
        opened = []
        for n, (session, prompt) in enumerate(items):
            try:
                self._sessions[session] = self._new_session(check_new_session(self, session, prompt))
                opened.append(n)
            except ModelError as exc:
                errors[n] = exc
        try:
            self._share_prefixes([items[n][0] for n in opened])
            self.score([(items[n][0], []) for n in opened if not self._sessions[items[n][0]].rows_held()])
        except ModelError:
            for n in opened:   # who refused it: each alone
                self.release(items[n][0])
                try:
                    self.open(*items[n])
                except ModelError as exc:
                    errors[n] = exc
        except BaseException:
            for n in opened:
                self.release(items[n][0])
            raise
        return errors

    def release(self, session: bytes) -> None:
        if self._sessions.pop(session, None) is None:
            raise UnknownSession(session)

    def committed(self, session: bytes) -> list[int]:
        return list(self._get(session).committed)

    def cached_tokens(self, session: bytes) -> list[int]:
        """Tokens whose K/V the session holds (for tests and diagnostics)."""
        return list(self._get(session).cached)

    def sessions(self) -> list[bytes]:
        return list(self._sessions)

    def commit(self, session: bytes, emitted: Sequence[int]) -> None:
        s = self._get(session)
        new_committed = s.committed + check_tokens(emitted, self.vocab_size, "emitted")
        self._check_length(len(new_committed))
        s.commit(new_committed)

    @torch.no_grad()  # not inference_mode: cached tensors are written again later
    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        if not items:
            return torch.empty(0, self.vocab_size, dtype=self.rows_dtype, device=self.rows_device)
        plans = []
        for sid, x in items:
            p = plan(self._get(sid), check_tokens(x, self.vocab_size, "proposal"))
            self._check_length(len(p.full))
            plans.append(p)
        self._reserve(plans)  # may raise KVCapacityError; nothing changed yet
        for p in plans:
            # Before the forward overwrites them: if it fails, the state stays consistent.
            p.session.truncate(p.start)
        todo = [p for p in plans if p.new_tokens]
        computed = self._compute(todo) if todo else {}
        return collect_rows(plans, computed, self.vocab_size, self.rows_device)

    def _check_length(self, n: int) -> None:
        check_length(n, self.max_seq_len)

    # -- memory (Backend.session_bytes / bytes_for): the part every caching backend shares --
    def _bookkeeping_bytes(self, s: CachedSession) -> int:
        """Kept logits rows and the two token lists a session holds now (K/V not included)."""
        rows = s.rows.numel() * s.rows.element_size() if s.rows is not None else 0
        return rows + token_list_bytes(len(s.committed)) + token_list_bytes(len(s.cached))

    def _bookkeeping_bytes_for(self, tokens: int) -> int:
        """The most `_bookkeeping_bytes` reaches for a session of `tokens` positions: the
        rows of a longest proposal and two token lists."""
        return MAX_ROWS * self.vocab_size * self.rows_dtype.itemsize + 2 * token_list_bytes(tokens)

    def _get(self, session: bytes) -> CachedSession:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSession(session) from None
