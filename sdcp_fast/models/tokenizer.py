"""The byte-level tokenizer of the built-in models: token id = byte value (V = 256).

Its description is a tiny JSON file ({"type": "bytes", "vocab_size": 256}); the tokenizer
digest is SHA-256 over that JSON in canonical form (sorted keys, no whitespace).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path


def canonical_json_digest(obj: object) -> bytes:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).digest()


class ByteTokenizer:
    vocab_size = 256
    description = {"type": "bytes", "vocab_size": 256}

    @classmethod
    def from_file(cls, path: str | Path) -> ByteTokenizer:
        desc = json.loads(Path(path).read_text())
        if desc != cls.description:
            raise ValueError(f"{path}: unsupported tokenizer description {desc!r}")
        return cls()

    @property
    def digest(self) -> bytes:
        return canonical_json_digest(self.description)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        # Replacement characters for split multi-byte sequences: decoding never raises.
        return bytes(tokens).decode("utf-8", errors="replace")
