"""The table backend: next-token logits depend only on the last token, through a [V, V] table.

`logits after sequence s = table[s[-1]]` exactly (fp32, no arithmetic), which makes the
target distribution of every position known in closed form: end-to-end statistical tests of
the verifier compare observed frequencies against it. Sessions hold only their committed
tokens; there is no K/V, so an exported blob carries just the committed sequence.

File format: safetensors with one fp32 tensor named "table" of shape [V, V]; write one with
`write_table`. Digest: the canonical weights digest (see `weights.py`) of kind "table".
The tokenizer is the identity over ids: `encode` takes space-separated decimal ids
("3 1 4"), `decode` writes them back the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..kernels.batch import list_tensor
from .base import (
    InvalidTokens,
    check_distinct_sessions,
    check_tokens,
)
from .token_sessions import TokenListSessions
from .tokenizer import canonical_json_digest
from .weights import canonical_digest, read_safetensors

TABLE_KEY = "table"


def write_table(path: str | Path, table: torch.Tensor) -> None:
    """Save a [V, V] logits table (row = previous token) as a table-model file."""
    if table.dim() != 2 or table.shape[0] != table.shape[1]:
        raise ValueError(f"table must be [V, V], got {list(table.shape)}")
    save_file({TABLE_KEY: table.detach().to(torch.float32).contiguous()}, str(path))


class TableBackend(TokenListSessions):
    kind = "table"

    def __init__(self, table: torch.Tensor) -> None:
        if table.dim() != 2 or table.shape[0] != table.shape[1] or table.dtype != torch.float32:
            raise ValueError("table must be a float32 [V, V] tensor")
        self.table = table.contiguous()
        self.vocab_size = table.shape[0]
        self.digest = canonical_digest(self.kind, "{}", {TABLE_KEY: self.table})
        self.tokenizer_digest = canonical_json_digest(
            {"type": "decimal-ids", "vocab_size": self.vocab_size}
        )
        self._sessions: dict[bytes, list[int]] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> TableBackend:
        tensors, _ = read_safetensors(path)
        if set(tensors) != {TABLE_KEY}:
            raise ValueError(f"{path}: a table file holds exactly one tensor named {TABLE_KEY!r}")
        return cls(tensors[TABLE_KEY])

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(w) for w in text.split()]
        except ValueError:
            raise InvalidTokens(f"table tokenizer takes decimal ids, got {text!r}") from None
        return check_tokens(ids, self.vocab_size, "text")

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(str(int(t)) for t in tokens)


    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        last = []
        sessions, v = self._sessions, self.vocab_size
        for session, x in items:
            c = sessions.get(session)
            if c is None:
                c = self._get(session)   # raises UnknownSession
            x = check_tokens(x, v, "proposal")
            last.append(c[-1])
            last.extend(x)
        return self.table.index_select(0, list_tensor(last, torch.int64))






