"""Session bookkeeping for backends that keep only each session's committed token list
(no K/V of their own): the table model and the Hugging Face backend. Their KV blobs carry
the committed sequence alone."""

from __future__ import annotations

from collections.abc import Sequence

from . import kvblob
from .base import (
    InvalidTokens,
    KVCapacityError,
    SessionExists,
    UnknownSession,
    check_tokens,
    token_list_bytes,
)


class TokenListSessions:
    """Mixin: `open`, `commit`, `committed`, `release`, `export_kv`, `import_kv` over
    `self._sessions: dict[bytes, list[int]]`. The host sets `kind`, `digest`, `vocab_size`
    and may cap sequence lengths with `max_seq_len` (None: no cap)."""

    kind: str
    digest: bytes
    vocab_size: int
    max_seq_len: int | None = None
    _sessions: dict[bytes, list[int]]

    def open(self, session: bytes, prompt: Sequence[int]) -> None:
        if session in self._sessions:
            raise SessionExists(f"session {session!r} is already open")
        prompt = check_tokens(prompt, self.vocab_size, "prompt")
        if not prompt:
            raise InvalidTokens("empty prompt: the model needs a previous token")
        self._check_length(len(prompt))
        self._sessions[session] = prompt

    def commit(self, session: bytes, emitted: Sequence[int]) -> None:
        committed = self._get(session)
        emitted = check_tokens(emitted, self.vocab_size, "emitted")
        self._check_length(len(committed) + len(emitted))
        committed.extend(emitted)

    def committed(self, session: bytes) -> list[int]:
        return list(self._get(session))

    def release(self, session: bytes) -> None:
        if self._sessions.pop(session, None) is None:
            raise UnknownSession(session)

    def export_kv(self, session: bytes) -> bytes:
        return kvblob.pack(self.kind, self.digest, self.vocab_size, self._get(session), None, 0)

    def import_kv(self, session: bytes, data: bytes) -> None:
        _, committed = kvblob.unpack_for(self, session, data)
        self._sessions[session] = committed

    def session_bytes(self, session: bytes) -> int:
        return token_list_bytes(len(self._get(session)))

    def bytes_for(self, tokens: int) -> int:
        """No K/V here: the committed token list is all a session holds."""
        if self.max_seq_len is not None:
            tokens = min(tokens, self.max_seq_len)
        return token_list_bytes(tokens)

    def _check_length(self, n: int) -> None:
        if self.max_seq_len is not None and n > self.max_seq_len:
            raise KVCapacityError(f"sequence of {n} tokens exceeds the model's {self.max_seq_len}")

    def _get(self, session: bytes) -> list[int]:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSession(session) from None
