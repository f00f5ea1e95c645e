"""`replay:PATH`: a draft for benchmarks that plays back recorded continuations.

A benchmark decodes its prompts with the target first (greedy) and writes what it got with
`write_replay`; a drafter serving `replay:PATH` then proposes exactly those tokens, at no
cost, so a run measures the serving path with a draft that is free and always right.

    {"format": "sdcp-replay/v1", "vocab_size": V, "tokenizer_digest": HEX,
     "sequences": [{"prompt": [...], "continuation": [...]}, ...]}

`score` returns, for each prefix C + x[:i], a row that puts all the mass on the recorded next
token (0 there, -1e4 elsewhere, so argmax and every sampling profile pick it) when the
prefix lies on a recorded prompt + continuation, and a flat row (all zeros) when it does
not (another prompt, a diverging token, past the recorded end).

Digest: SHA-256 over the canonical JSON of the recorded sequences and vocabulary size, so
a contract can permit exactly this draft. Tokenizer digest: the recorded target's, which
the drafter must match; there is no tokenizer (encode/decode raise ModelError).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from .base import ModelError, check_distinct_sessions, check_tokens, common_prefix_length
from .token_sessions import TokenListSessions
from .tokenizer import canonical_json_digest

FORMAT = "sdcp-replay/v1"
OFF_RECORD = -1e4  # logit of every token but the recorded one


def write_replay(
    path: str | Path,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    vocab_size: int,
    tokenizer_digest: bytes,
) -> None:
    """Record (prompt, continuation) pairs for a `replay:` drafter."""
    doc = {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "tokenizer_digest": tokenizer_digest.hex(),
        "sequences": [
            {"prompt": [int(t) for t in p], "continuation": [int(t) for t in c]}
            for p, c in sequences
        ],
    }
    Path(path).write_text(json.dumps(doc, separators=(",", ":")))


class ReplayBackend(TokenListSessions):
    kind = "replay"

    def __init__(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        vocab_size: int,
        tokenizer_digest: bytes,
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_digest = tokenizer_digest
        self._records = []  # (prompt length, prompt + continuation)
        for prompt, continuation in sequences:
            prompt = check_tokens(prompt, vocab_size, "recorded prompt")
            full = prompt + check_tokens(continuation, vocab_size, "recorded continuation")
            self._records.append((len(prompt), full))
        self.digest = canonical_json_digest(
            {
                "kind": self.kind,
                "vocab_size": vocab_size,
                "sequences": [[full[:n], full[n:]] for n, full in self._records],
            }
        )
        self._sessions: dict[bytes, list[int]] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayBackend:
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
            pairs = [(s["prompt"], s["continuation"]) for s in doc["sequences"]]
            return cls(pairs, int(doc["vocab_size"]), bytes.fromhex(doc["tokenizer_digest"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a replay file: {e}") from None

    def encode(self, text: str) -> list[int]:
        raise ModelError("replay: backends have no tokenizer")

    def decode(self, tokens: Sequence[int]) -> str:
        raise ModelError("replay: backends have no tokenizer")

    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        rows = []
        for session, x in items:
            committed = self._get(session)
            seq = committed + check_tokens(x, self.vocab_size, "proposal")
            on_record, full = self._follow(committed, seq)
            block = torch.zeros(len(x) + 1, self.vocab_size)
            for i in range(len(x) + 1):
                n = len(committed) + i  # the prefix seq[:n] this row follows
                if n <= on_record and n < len(full):
                    block[i] = OFF_RECORD
                    block[i, full[n]] = 0.0
            rows.append(block)
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def _follow(self, committed: list[int], seq: list[int]) -> tuple[int, list[int]]:
        """(how long a prefix of seq lies on the best matching record, that record); a record
        matches only if the committed sequence lies on it past the recorded prompt."""
        best, best_full = -1, []
        for prompt_len, full in self._records:
            if len(committed) < prompt_len:
                continue
            h = common_prefix_length(full, seq)
            if h >= len(committed) and h > best:
                best, best_full = h, full
        return best, best_full
