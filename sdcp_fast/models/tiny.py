"""The built-in backend: `gpt.Transformer` with a per-session KV cache.

Per session we hold
  * `committed`: the committed sequence C (prompt + committed output);
  * `cached`: the tokens whose K/V sits in the session's buffer, positions 0..len-1. It is a
    prefix of C, possibly extended by the last scored proposal (speculative positions);
  * `rows`: next-token logits after cached positions rows_start..len(cached)-1, kept only for
    positions >= len(C) - 1, so a drafter that scores a growing proposal step by step gets the
    earlier rows back without recomputing them (at most len(proposal) + 1 rows of V floats).

`score` finds, per session, the longest prefix of C + x it already holds, truncates the rest,
and feeds only the missing tokens; all sessions' missing tokens go through one packed forward.

Memory: each buffer is [n_layer, 2, H, capacity, Dh] in the model's dtype and grows by
doubling up to `max_seq_len` positions (the per-session cap). The sum of all buffers' bytes
is capped by `max_kv_bytes` (default 1 GiB). Either cap raises `KVCapacityError` before any
state changes.

Device and dtype (`device="cuda"`, `dtype=torch.bfloat16`; the CPU and fp32 by default):
weights, K/V buffers and logits live there, and `score` returns logits in the model's dtype
on its device, so a verifier hands them to the kernels with no host copy. A model served in
another dtype than its file's has its own digest (the file's, tagged with the dtype).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import kvblob
from .base import (
    InvalidTokens,
    KVCapacityError,
    KVImportError,
    SessionExists,
    UnknownSession,
    check_distinct_sessions,
    check_tokens,
    common_prefix_length,
    token_list_bytes,
)
from .gpt import RaggedBatch, Transformer, rope_table
from .tokenizer import ByteTokenizer
from .weights import load_tiny

DEFAULT_MAX_KV_BYTES = 1 << 30
MIN_CAPACITY = 64
MAX_ROWS = 65   # logits rows kept for the last proposal: at most m_max (64) + 1


@dataclass
class _Session:
    committed: list[int]
    cached: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None  # [n_layer, 2, H, capacity, Dh], model dtype and device
    rows_start: int = 0
    rows: torch.Tensor | None = None  # [len(cached) - rows_start, V] logits

    def truncate(self, n: int) -> None:
        """Forget cached positions >= n (their K/V and logits rows)."""
        if n >= len(self.cached):
            return
        del self.cached[n:]
        if self.rows is not None:
            keep = max(0, n - self.rows_start)
            self.rows = self.rows[:keep]

    def drop_rows_before(self, pos: int) -> None:
        if self.rows is None or pos <= self.rows_start:
            return
        self.rows = self.rows[pos - self.rows_start :]
        self.rows_start = pos


@dataclass(frozen=True)
class _Plan:
    session: _Session
    full: list[int]  # C + x
    first_row: int  # position of the first requested row: len(C) - 1
    start: int  # first position to compute (cached K/V kept below it)
    reuse_rows: bool  # whether rows for positions first_row..start-1 come from the cache


class TinyBackend:
    kind = "tiny"

    def __init__(
        self,
        model: Transformer,
        digest: bytes,
        tokenizer: ByteTokenizer | None = None,
        *,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype}")
        self.model = model.to(device=self.device, dtype=self.dtype)
        self.model.rope = rope_table(model.cfg).to(self.device)  # fp32 in any dtype
        if self.dtype != torch.float32:
            tag = str(self.dtype).removeprefix("torch.").encode()
            digest = hashlib.sha256(b"sdcp-fast tiny dtype=" + tag + b"\0" + digest).digest()
        self.cfg = model.cfg
        self.tokenizer = tokenizer or ByteTokenizer()
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise ValueError("tokenizer vocabulary larger than the model's")
        self.vocab_size = self.cfg.vocab_size
        self.digest = digest
        self.tokenizer_digest = self.tokenizer.digest
        self.max_kv_bytes = max_kv_bytes
        self._sessions: dict[bytes, _Session] = {}
        self._kv_bytes = 0  # sum of all sessions' buffer sizes, kept in step with them
        self._itemsize = self.dtype.itemsize
        self._bytes_per_position = self._itemsize * self.cfg.n_layer * 2 * self.cfg.d_model

    @classmethod
    def from_file(cls, path: str | Path, tokenizer_path: str | Path | None = None, **kw):
        model, digest = load_tiny(path)
        tok = ByteTokenizer.from_file(tokenizer_path) if tokenizer_path else ByteTokenizer()
        return cls(model, digest, tok, **kw)

    # -- text -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- sessions ---------------------------------------------------------------------------
    def open(self, session: bytes, prompt: Sequence[int]) -> None:
        if session in self._sessions:
            raise SessionExists(f"session {session!r} is already open")
        prompt = check_tokens(prompt, self.vocab_size, "prompt")
        if not prompt:
            raise InvalidTokens("empty prompt: the model has no BOS token to start from")
        self._check_length(len(prompt))
        self._sessions[session] = self._new_session(prompt)
        try:
            self.score([(session, [])])  # prefill; also caches the first row of logits
        except BaseException:
            self.release(session)
            raise

    def _new_session(self, committed: list[int]) -> _Session:
        """A session's state (a subclass may attach its own resources, or refuse)."""
        return _Session(committed=committed)

    def committed(self, session: bytes) -> list[int]:
        return list(self._get(session).committed)

    def release(self, session: bytes) -> None:
        s = self._sessions.pop(session, None)
        if s is None:
            raise UnknownSession(session)
        if s.buffer is not None:
            self._kv_bytes -= s.buffer.numel() * self._itemsize

    def sessions(self) -> list[bytes]:
        return list(self._sessions)

    def kv_bytes(self) -> int:
        """Bytes currently allocated to KV buffers (what `max_kv_bytes` caps)."""
        return self._kv_bytes

    def session_bytes(self, session: bytes) -> int:
        s = self._get(session)
        kv = s.buffer.numel() * self._itemsize if s.buffer is not None else 0
        rows = s.rows.numel() * self._itemsize if s.rows is not None else 0
        return kv + rows + token_list_bytes(len(s.committed)) + token_list_bytes(len(s.cached))

    def bytes_for(self, tokens: int) -> int:
        """The KV buffer a session of `tokens` positions grows to (capacity doubles, capped
        at max_seq_len), the logits rows of a longest proposal, two token lists."""
        tokens = min(tokens, self.cfg.max_seq_len)
        kv = self._capacity_for(tokens, self.cfg.max_seq_len) * self._bytes_per_position
        return kv + MAX_ROWS * self.vocab_size * self._itemsize + 2 * token_list_bytes(tokens)

    def cached_tokens(self, session: bytes) -> list[int]:
        """Tokens whose K/V the session holds (for tests and diagnostics)."""
        return list(self._get(session).cached)

    def commit(self, session: bytes, emitted: Sequence[int]) -> None:
        s = self._get(session)
        emitted = check_tokens(emitted, self.vocab_size, "emitted")
        new_committed = s.committed + emitted
        self._check_length(len(new_committed))
        h = common_prefix_length(s.cached, new_committed)
        if h < min(len(s.cached), len(new_committed)):
            s.truncate(h)  # rejected positions: their K/V contradicts the committed sequence
        s.committed = new_committed
        s.drop_rows_before(len(new_committed) - 1)
        if s.rows is not None and s.rows_start + len(s.rows) <= len(new_committed) - 1:
            s.rows, s.rows_start = None, len(s.cached)

    # -- scoring ----------------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: cached tensors are written again later
    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        if not items:
            return torch.empty(0, self.vocab_size, dtype=self.dtype, device=self.device)
        plans = [
            self._plan(self._get(sid), check_tokens(x, self.vocab_size, "proposal"))
            for sid, x in items
        ]
        self._reserve(plans)  # may raise KVCapacityError; nothing changed yet
        for p in plans:
            # Before the forward overwrites them: if it fails, the state stays consistent.
            p.session.truncate(p.start)
        todo = [p for p in plans if p.start < len(p.full)]
        computed = self._forward(todo) if todo else []
        out = []
        by_plan = dict(zip(map(id, todo), computed, strict=True))
        for p in plans:
            s = p.session
            new_rows = by_plan.get(id(p))
            if new_rows is not None:
                s.cached.extend(p.full[p.start :])
            if p.reuse_rows:
                s.drop_rows_before(p.first_row)
                old = s.rows if s.rows is not None else torch.empty(
                    0, self.vocab_size, dtype=self.dtype, device=self.device)
                s.rows = old if new_rows is None else torch.cat([old, new_rows])
            else:  # computed from p.start <= first_row; rows come from first_row on
                s.rows_start = p.first_row
                s.rows = new_rows
            out.append(s.rows[: len(p.full) - p.first_row])
        return torch.cat(out)

    def _plan(self, s: _Session, x: list[int]) -> _Plan:
        full = s.committed + x
        self._check_length(len(full))
        first_row = len(s.committed) - 1
        h = common_prefix_length(s.cached, full)
        rows_end = s.rows_start + (len(s.rows) if s.rows is not None else 0)
        rows_end = min(rows_end, h)
        if s.rows is not None and s.rows_start <= first_row < rows_end:
            # rows for first_row..rows_end-1 are cached; compute from rows_end on
            return _Plan(s, full, first_row, rows_end, True)
        return _Plan(s, full, first_row, min(h, first_row), False)

    def _forward(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """Feed each plan's tokens from p.start on; return, per plan, the logits rows of
        positions max(p.start, p.first_row) onwards (earlier rows are never asked for)."""
        tokens, positions, starts, pasts, caches, rows, row_starts = [], [], [0], [], [], [], [0]
        for p in plans:
            new = p.full[p.start :]
            first = max(p.start, p.first_row)
            rows.extend(range(starts[-1] + first - p.start, starts[-1] + len(new)))
            row_starts.append(len(rows))
            tokens.extend(new)
            positions.extend(range(p.start, len(p.full)))
            starts.append(starts[-1] + len(new))
            pasts.append(p.start)
            caches.append(self._ensure_capacity(p.session, len(p.full)))
        logits = self.model.forward_cached(
            RaggedBatch(
                tokens=torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True),
                positions=torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
                starts=starts,
                past_lengths=pasts,
                caches=caches,
            ),
            rows=None if len(rows) == len(tokens) else torch.tensor(rows, dtype=torch.long).to(self.device),
        )
        # Copies: a session's cached rows must not pin the whole batch's logits in memory.
        return [logits[row_starts[b] : row_starts[b + 1]].clone() for b in range(len(plans))]

    # -- memory -----------------------------------------------------------------------------
    def _check_length(self, n: int) -> None:
        if n > self.cfg.max_seq_len:
            raise KVCapacityError(
                f"sequence of {n} tokens exceeds the model's max_seq_len {self.cfg.max_seq_len}"
            )

    @staticmethod
    def _capacity_for(n: int, limit: int) -> int:
        cap = MIN_CAPACITY
        while cap < n:
            cap *= 2
        return min(cap, limit)

    def _reserve(self, plans: list[_Plan]) -> None:
        extra = 0
        for p in plans:
            have = p.session.buffer.shape[3] if p.session.buffer is not None else 0
            if len(p.full) > have:
                extra += self._capacity_for(len(p.full), self.cfg.max_seq_len) - have
        if self.kv_bytes() + extra * self._bytes_per_position > self.max_kv_bytes:
            raise KVCapacityError(
                f"KV cache would grow to {self.kv_bytes() + extra * self._bytes_per_position} "
                f"bytes, over max_kv_bytes={self.max_kv_bytes}; release sessions"
            )

    def _ensure_capacity(self, s: _Session, n: int) -> torch.Tensor:
        if s.buffer is None or s.buffer.shape[3] < n:
            cfg = self.cfg
            cap = self._capacity_for(n, cfg.max_seq_len)
            buf = torch.empty(cfg.n_layer, 2, cfg.n_head, cap, cfg.head_dim,
                              dtype=self.dtype, device=self.device)
            if s.buffer is not None:
                buf[:, :, :, : len(s.cached)] = s.buffer[:, :, :, : len(s.cached)]
                self._kv_bytes -= s.buffer.numel() * self._itemsize
            self._kv_bytes += buf.numel() * self._itemsize
            s.buffer = buf
        return s.buffer

    # -- export / import --------------------------------------------------------------------
    def export_kv(self, session: bytes) -> bytes:
        """The committed sequence and the K/V of its cached prefix (speculative K/V dropped)."""
        s = self._get(session)
        n = common_prefix_length(s.cached, s.committed)
        kv = s.buffer[:, :, :, :n].cpu() if s.buffer is not None and n else None
        return kvblob.pack(self.kind, self.digest, self.vocab_size, s.committed, kv, n)

    def import_kv(self, session: bytes, data: bytes) -> None:
        blob, committed = kvblob.unpack_for(self, session, data)
        cfg = self.cfg
        expect = [cfg.n_layer, 2, cfg.n_head, blob.kv_tokens, cfg.head_dim]
        if blob.kv is not None and list(blob.kv.shape) != expect:
            raise KVImportError(f"KV shape {list(blob.kv.shape)} does not match model {expect}")
        if blob.kv is None and blob.kv_tokens:
            raise KVImportError("KV blob claims cached tokens but carries no K/V")
        s = self._new_session(committed)
        if blob.kv_tokens:
            need = self._capacity_for(blob.kv_tokens, cfg.max_seq_len) * self._bytes_per_position
            if self.kv_bytes() + need > self.max_kv_bytes:
                raise KVCapacityError(f"importing would exceed max_kv_bytes={self.max_kv_bytes}")
            self._ensure_capacity(s, blob.kv_tokens)
            s.buffer[:, :, :, : blob.kv_tokens] = blob.kv
            s.cached = committed[: blob.kv_tokens]
        s.rows_start = len(s.cached)
        self._sessions[session] = s

    def _get(self, session: bytes) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSession(session) from None
