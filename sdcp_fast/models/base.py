"""The backend interface shared by the verifier and the drafter, and its typed errors.

A *session* is a byte string naming one sequence. Its *committed* sequence C is the prompt
plus every token committed since; `score` evaluates proposals on top of C without changing
it, and `commit` appends what the verdict emitted. Backends keep K/V for a prefix of
C + (the last proposal) and reuse it; see each backend for how much it caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


class ModelError(Exception):
    """Base class of every error this package raises on bad input or state."""


class UnknownSession(ModelError, KeyError):
    """The session was never opened, or was released."""


class SessionExists(ModelError):
    """`open` or `import_kv` for a session id already in use (release it first)."""


class InvalidTokens(ModelError, ValueError):
    """A token id outside [0, vocab_size), or an empty prompt (there is no BOS token)."""


class KVCapacityError(ModelError, MemoryError):
    """The KV memory cap (or the per-session length cap) would be exceeded.

    Raised before any state changes, so the caller may release sessions and retry.
    """


class KVImportError(ModelError, ValueError):
    """A KV blob that is truncated, corrupt, of another format, or from another model."""


class BackendSpecError(ModelError, ValueError):
    """`load_backend` got a spec it cannot resolve."""


@runtime_checkable
class Backend(Protocol):
    vocab_size: int
    digest: bytes  # SHA-256 of the weights, canonical (the contract's `target`)
    tokenizer_digest: bytes  # SHA-256 of the canonical tokenizer description

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def open(self, session: bytes, prompt: Sequence[int]) -> None:
        """Start a session whose committed sequence is `prompt` (non-empty) and prefill it."""

    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        """Logits [sum(len(x_b) + 1), V]: for each (session b, proposal x_b) in order, the
        next-token logits after C_b, C_b + x_b[:1], ..., C_b + x_b. One forward pass. fp32
        on the CPU; a backend with a `device` attribute returns them there, in its dtype."""

    def commit(self, session: bytes, emitted: Sequence[int]) -> None:
        """Append `emitted` to the committed sequence; drop K/V that contradicts it."""

    def committed(self, session: bytes) -> list[int]: ...

    def release(self, session: bytes) -> None: ...

    def export_kv(self, session: bytes) -> bytes: ...

    def import_kv(self, session: bytes, data: bytes) -> None: ...

    def session_bytes(self, session: bytes) -> int:
        """Memory the session holds in this backend now: its KV cache as allocated, cached
        logits rows, its token lists."""

    def bytes_for(self, tokens: int) -> int:
        """The most memory a session of `tokens` positions holds in this backend (what a
        service reserves before admitting a session: memory budgets, verifier and drafter)."""


def open_many(backend, items: Sequence[tuple[bytes, Sequence[int]]]) -> list[ModelError | None]:
    """`backend.open` for each (session, prompt): one packed prefill where the backend has
    `open_many` (prefix_cache.CachingBackend), else one by one. Per item: None, or the
    ModelError that refused it."""
    many = getattr(backend, "open_many", None)
    if many is not None:
        return many(items)
    errors: list[ModelError | None] = []
    for session, prompt in items:
        try:
            backend.open(session, prompt)
            errors.append(None)
        except ModelError as exc:
            errors.append(exc)
    return errors


# A token in a Python list: an 8-byte slot plus, above 256, its own 28-byte int object.
TOKEN_LIST_BYTES_PER_TOKEN = 36
LIST_OVERHEAD = 56


def token_list_bytes(n: int) -> int:
    return LIST_OVERHEAD + TOKEN_LIST_BYTES_PER_TOKEN * n


_INT_ONLY = {int}


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> list[int]:
    # the usual input (plain ints in range) in C calls, on every round's hot path; anything
    # else (and every refusal) item by item
    if tokens and set(map(type, tokens)) == _INT_ONLY and min(tokens) >= 0 and max(tokens) < vocab_size:
        return list(tokens)
    out = [int(t) for t in tokens]
    for t in out:
        if not 0 <= t < vocab_size:
            raise InvalidTokens(f"{what}: token {t} outside [0, {vocab_size})")
    return out


def check_length(n: int, max_seq_len: int | None) -> None:
    if max_seq_len is not None and n > max_seq_len:
        raise KVCapacityError(f"sequence of {n} tokens exceeds max_seq_len {max_seq_len}")


def check_new_session(backend, session: bytes, prompt: Sequence[int]) -> list[int]:
    """What `open` checks before any state changes: the session id is free and the prompt is
    non-empty, in the vocabulary and within the backend's length cap. Returns the prompt."""
    if session in backend._sessions:
        raise SessionExists(f"session {session!r} is already open")
    prompt = check_tokens(prompt, backend.vocab_size, "prompt")
    if not prompt:
        raise InvalidTokens("empty prompt: the model has no BOS token to start from")
    check_length(len(prompt), backend.max_seq_len)
    return prompt


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared in C
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def check_distinct_sessions(items: Sequence[tuple[bytes, Sequence[int]]]) -> None:
    seen = set()
    for session, _ in items:
        if session in seen:
            raise ModelError(f"session {session!r} appears twice in one score batch")
        seen.add(session)
