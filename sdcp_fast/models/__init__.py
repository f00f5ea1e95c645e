"""Model backends with per-session KV cache: the verifier's scorer and the drafter's model.

Interface (typing.Protocol `Backend`, base.py). Sessions are named by bytes; C_b is a
session's committed sequence (prompt + committed output).

    vocab_size: int
    digest: bytes            # SHA-256, canonical over config + tensors in name order
                             # (weights.canonical_digest): the contract's `target`
    tokenizer_digest: bytes  # SHA-256 of the canonical tokenizer description
    encode(text: str) -> list[int]
    decode(tokens: Sequence[int]) -> str
    open(session: bytes, prompt: Sequence[int]) -> None          # prefill; prompt non-empty
    score(items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor
        # [sum(len(x_b) + 1), V] (fp32 on the CPU; on the backend's `device`, in its dtype,
        # when it has one); for each (session b, proposal x_b), in order, the
        # next-token logits after C_b, C_b + x_b[:1], ..., C_b + x_b. One batched forward.
        # Does not change C_b; caches K/V (and logits rows) of the proposal for reuse.
    commit(session: bytes, emitted: Sequence[int]) -> None       # C_b += emitted; K/V that
                                                                  # contradicts C_b is dropped
    committed(session: bytes) -> list[int]
    release(session: bytes) -> None
    export_kv(session: bytes) -> bytes          # self-describing (kvblob.py), checksummed
    import_kv(session: bytes, data: bytes) -> None

    load_backend(spec: str, **options) -> Backend
        # "tiny:demo-target" | "tiny:demo-draft" | "tiny:PATH" | "table:PATH" | "hf:PATH"
        # | "hf:FILE.gguf" | "hf:smollm2" | "replay:PATH"; options after "?"
        # (spec_options.py), e.g. "hf:PATH?dtype=bfloat16&device=cuda&threads=4"
        # drafts for a real target: "gguf:SOURCE" | "ngram:TOKENIZER" | "distilled:NAME"

Errors (base.py), all subclasses of ModelError: UnknownSession, SessionExists,
InvalidTokens, KVCapacityError (tiny and hf: max_kv_bytes, default 1 GiB, and max_seq_len per
session; raised before any state changes), KVImportError, BackendSpecError.

Backends are not thread-safe: one caller (e.g. the verifier's engine thread) drives each
instance. Prompts must be non-empty (there is no BOS token).

Backends: tiny.TinyBackend (built-in GPT, real KV cache, packed ragged batch),
table.TableBackend (+ table.write_table), hf.HFBackend (transformers models and GGUF files,
K/V in one paged pool, packed ragged batch; lazy import), replay.ReplayBackend (a free,
always-right draft for benchmarks that plays back recorded continuations),
llamacpp.LlamaCppBackend (llama.cpp, a TinyBackend subclass), ngram.NgramBackend (prompt
lookup, no model), distilled.load_distilled (a TinyBackend over a draft built on the
target's GGUF).
"""

from .base import (
    Backend,
    BackendSpecError,
    InvalidTokens,
    KVCapacityError,
    KVImportError,
    ModelError,
    SessionExists,
    UnknownSession,
)
from .loader import DEMO_DIR, load_backend
from .table import write_table

__all__ = [
    "Backend",
    "BackendSpecError",
    "DEMO_DIR",
    "InvalidTokens",
    "KVCapacityError",
    "KVImportError",
    "ModelError",
    "SessionExists",
    "UnknownSession",
    "load_backend",
    "write_table",
]
