"""`ngram:` prompt-lookup drafting: no model, proposals copied from the session's own text.

    ngram:TOKENIZER?n=3&min=1

TOKENIZER names the target's tokenizer (see `real_tokenizer.load_tokenizer`: `smollm2`, a
.gguf file, a transformers directory, or `bytes` for the built-in byte-level pair), so the
backend's vocabulary and tokenizer digest are the target's. `n` is the longest n-gram tried
(default 3), `min` the shortest (default 1).

The proposal after a sequence s is found as transformers' prompt lookup and vLLM's `ngram`
proposer find it: take the last k tokens of s for k = n, n-1, ..., min; find an earlier
occurrence of them in s; propose the token that followed it. Where both would pick the
first occurrence, this picks the most recent one (the nearer context is the likelier one to
be copied again: a list being continued, a name just repeated).

Nothing matches: the backend still has to give a valid row, so it proposes the most
frequent token of the committed sequence (ties to the one seen first): a unigram model of
the session's own text, which in English prose is a word like " the" or "," and right a few
percent of the time, where repeating the last token is right almost never. `match_length`
tells a drafter whether a proposal was a real match (part of choosing M).

Logits rows are one-hot in the probability sense: 0.0 at the proposed token and -inf
elsewhere, so q = softmax(row / T) is exactly 1 at the proposal for every sampling profile
(rule 2 then accepts with probability min(1, p(x)) and resamples from the residual of p,
exactly as the spec says for a q that is one-hot) and the argmax is the proposal (rule 1).

State per session: the committed tokens, an index {n-gram: position of the token that
followed its latest occurrence} over them, and token counts, all extended on commit; a
proposal's own tokens are searched by a short scan at each `score`. Export carries the
committed tokens; import rebuilds the index (there is no K/V).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import kvblob
from .base import (
    UnknownSession,
    check_distinct_sessions,
    check_length,
    check_new_session,
    check_tokens,
    token_list_bytes,
)
from .real_tokenizer import load_tokenizer
from .spec_options import split_options
from .weights import canonical_digest

DEFAULT_MAX_SEQ_LEN = 1 << 16


@dataclass
class _Session:
    n: int
    min_n: int
    tokens: list[int] = field(default_factory=list)
    follower: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> next pos
    counts: dict[int, int] = field(default_factory=dict)
    most_frequent: int = 0

    def extend(self, new: Sequence[int]) -> None:
        for t in new:
            p = len(self.tokens)
            for k in range(self.min_n, self.n + 1):
                if p >= k:
                    self.follower[tuple(self.tokens[p - k : p])] = p
            self.tokens.append(t)
            c = self.counts.get(t, 0) + 1
            self.counts[t] = c
            if c > self.counts.get(self.most_frequent, 0):
                self.most_frequent = t

    def propose(self, seq: list[int]) -> tuple[int, int]:
        """(proposed next token after `seq`, length of the n-gram matched, 0 if none).
        `seq` is the committed tokens followed by speculative ones."""
        committed = len(self.tokens)
        j = len(seq)
        for k in range(min(self.n, j - 1), self.min_n - 1, -1):
            suffix = seq[j - k :]
            # most recent first: occurrences ending inside the speculative tail (short scan)
            for end in range(j - 2, max(committed - 1, k - 1) - 1, -1):
                if seq[end - k + 1 : end + 1] == suffix:
                    return seq[end + 1], k
            pos = self.follower.get(tuple(suffix))
            if pos is not None:  # an occurrence in the committed part (always before j)
                return self.tokens[pos], k
        return self.most_frequent, 0


class NgramBackend:
    kind = "ngram"

    def __init__(
        self, tokenizer, *, n: int = 3, min_n: int = 1, max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    ) -> None:
        if not 1 <= min_n <= n:
            raise ValueError(f"ngram: need 1 <= min <= n, got min={min_n} n={n}")
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.tokenizer_digest = tokenizer.digest
        self.n, self.min_n, self.max_seq_len = n, min_n, max_seq_len
        config = {"n": n, "min": min_n, "tokenizer": tokenizer.digest.hex()}
        self.digest = canonical_digest(self.kind, json.dumps(config, sort_keys=True), {})
        self._sessions: dict[bytes, _Session] = {}

    @classmethod
    def from_spec(cls, arg: str, **options) -> NgramBackend:
        source, opts = split_options(arg, {"n": int, "min": int}, "ngram")
        return cls(
            load_tokenizer(source), n=opts.get("n", 3), min_n=opts.get("min", 1), **options
        )

    # -- text -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- sessions ---------------------------------------------------------------------------
    def open(self, session: bytes, prompt: Sequence[int]) -> None:
        prompt = check_new_session(self, session, prompt)
        s = _Session(self.n, self.min_n)
        s.extend(prompt)
        self._sessions[session] = s

    def commit(self, session: bytes, emitted: Sequence[int]) -> None:
        s = self._get(session)
        emitted = check_tokens(emitted, self.vocab_size, "emitted")
        self._check_length(len(s.tokens) + len(emitted))
        s.extend(emitted)

    def committed(self, session: bytes) -> list[int]:
        return list(self._get(session).tokens)

    def release(self, session: bytes) -> None:
        if self._sessions.pop(session, None) is None:
            raise UnknownSession(session)

    def session_bytes(self, session: bytes) -> int:
        return self.bytes_for(len(self._get(session).tokens))

    def bytes_for(self, tokens: int) -> int:
        """No K/V: the token list, and per token one n-gram index entry per length (a tuple
        key of up to n ints and its dict slot: about 150 bytes)."""
        tokens = min(tokens, self.max_seq_len)
        return token_list_bytes(tokens) + tokens * (self.n - self.min_n + 1) * 150

    def export_kv(self, session: bytes) -> bytes:
        tokens = self._get(session).tokens
        return kvblob.pack(self.kind, self.digest, self.vocab_size, tokens, None, 0)

    def import_kv(self, session: bytes, data: bytes) -> None:
        _, committed = kvblob.unpack_for(self, session, data)
        s = _Session(self.n, self.min_n)
        s.extend(committed)
        self._sessions[session] = s

    # -- drafting ---------------------------------------------------------------------------
    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        proposals = []
        for session, x in items:
            s = self._get(session)
            seq = s.tokens + check_tokens(x, self.vocab_size, "proposal")
            self._check_length(len(seq))
            proposals.extend(s.propose(seq[:j])[0] for j in range(len(s.tokens), len(seq) + 1))
        rows = torch.full((len(proposals), self.vocab_size), float("-inf"))
        rows[torch.arange(len(proposals)), torch.tensor(proposals, dtype=torch.long)] = 0.0
        return rows

    def match_length(self, session: bytes, proposal: Sequence[int] = ()) -> int:
        """Length of the n-gram that the next proposal after C + proposal copies (0: none,
        the proposal is the fallback token)."""
        s = self._get(session)
        return s.propose(s.tokens + check_tokens(proposal, self.vocab_size, "proposal"))[1]

    def _check_length(self, n: int) -> None:
        check_length(n, self.max_seq_len)

    def _get(self, session: bytes) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSession(session) from None
