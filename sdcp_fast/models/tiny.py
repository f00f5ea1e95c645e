"""The built-in backend: `gpt.Transformer` with a per-session KV cache.

Per session we hold the committed sequence, the tokens whose K/V sits in the session's
buffer and the logits rows kept for a growing proposal (prefix_cache.py, shared with hf.py).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kvblob
from .base import KVCapacityError, KVImportError
from .gpt import RaggedBatch, Transformer, rope_table
from .prefix_cache import CachedSession, CachingBackend, Plan
from .tokenizer import ByteTokenizer
from .weights import load_tiny

DEFAULT_MAX_KV_BYTES = 1 << 30
MIN_CAPACITY = 64


@dataclass(eq=False)
class _Session(CachedSession):
    buffer: torch.Tensor | None = None  # [n_layer, 2, H, capacity, Dh] fp32; K/V beyond
    # len(cached) is stale and overwritten by the next forward, so truncate keeps it


class TinyBackend(CachingBackend):
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
        self.max_seq_len = self.cfg.max_seq_len  # the RoPE table's length: a session's cap
        self._sessions: dict[bytes, _Session] = {}
        self._kv_bytes = 0  # sum of all sessions' buffer sizes, kept in step with them
        self._itemsize = self.dtype.itemsize
        self.rows_device, self.rows_dtype = self.device, self.dtype  # score's logits
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

    # -- sessions (open, commit, score: prefix_cache.CachingBackend) ------------------------
    def _new_session(self, committed: list[int]) -> _Session:
        """A session's state (a subclass may attach its own resources, or refuse)."""
        return _Session(committed=committed)

    def release(self, session: bytes) -> None:
        s = self._get(session)
        super().release(session)
        if s.buffer is not None:
            self._kv_bytes -= s.buffer.numel() * self._itemsize

    def kv_bytes(self) -> int:
        """Bytes currently allocated to KV buffers (what `max_kv_bytes` caps)."""
        return self._kv_bytes

    def session_bytes(self, session: bytes) -> int:
        s = self._get(session)
        kv = s.buffer.numel() * self._itemsize if s.buffer is not None else 0
        return kv + self._bookkeeping_bytes(s)

    def bytes_for(self, tokens: int) -> int:
        """The KV buffer a session of `tokens` positions grows to (capacity doubles, capped
        at max_seq_len), the logits rows of a longest proposal, two token lists."""
        tokens = min(tokens, self.cfg.max_seq_len)
        kv = self._capacity_for(tokens, self.cfg.max_seq_len) * self._bytes_per_position
        return kv + self._bookkeeping_bytes_for(tokens)

    # -- scoring ----------------------------------------------------------------------------
    def _compute(self, plans: list[Plan]) -> dict[int, torch.Tensor]:
        return {id(p): rows for p, rows in zip(plans, self._forward(plans), strict=True)}

    def _forward(self, plans: list[Plan]) -> list[torch.Tensor]:
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
        )  # the model's dtype, on its device: a verifier hands them to the kernels as they are
        return [logits[row_starts[b] : row_starts[b + 1]] for b in range(len(plans))]

    # -- memory -----------------------------------------------------------------------------
    @staticmethod
    def _capacity_for(n: int, limit: int) -> int:
        cap = MIN_CAPACITY
        while cap < n:
            cap *= 2
        return min(cap, limit)

    def _reserve(self, plans: list[Plan]) -> None:
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
        n = s.committed_kv_tokens()
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
