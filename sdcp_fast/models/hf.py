"""Hugging Face transformers backend (`hf:PATH`, the `[hf]` extra; imported lazily).

Loads a causal LM and its tokenizer from a local directory (never the network:
`local_files_only=True`), in fp32 on the CPU.

KV choice: **recomputation**. Each `score` runs one batched forward over the full sequences
C_b + x_b of all sessions (left-padded, with an attention mask and explicit position ids) and
returns the requested rows. That keeps one code path correct for every architecture
transformers supports, at the cost of O(len(C)) work per call; the built-in `tiny` backend is
the one with a real per-session KV cache. Consequently a session holds only its committed
tokens, `export_kv` carries only those, and `import_kv` needs nothing else.

Bounds: sequences longer than the model's position limit (`max_position_embeddings` /
`n_positions`, when the config has one) raise `KVCapacityError`, and so does a batch of more
than `max_batch_tokens` padded positions (default 65536), which bounds activation memory.

Digest: canonical weights digest (see `weights.py`) of kind "hf" over the state dict's
tensors and the config as canonical JSON without transformers' bookkeeping keys
(`transformers_version`, `dtype`, `torch_dtype`, and keys starting with "_").
Tokenizer digest: SHA-256 of the canonical JSON of the fast tokenizer's full description
plus its special-token map.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from .base import (
    KVCapacityError,
    check_distinct_sessions,
    check_tokens,
)
from .token_sessions import TokenListSessions
from .tokenizer import canonical_json_digest
from .weights import canonical_digest

_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype"}


class HFBackend(TokenListSessions):
    kind = "hf"

    def __init__(self, path: str | Path, *, max_batch_tokens: int = 1 << 16) -> None:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("hf: backends need the [hf] extra (transformers)") from e
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"hf: model directory not found: {path}")
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, local_files_only=True
        )
        self.model.eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_seq_len = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        self.max_batch_tokens = max_batch_tokens
        config_dict = {
            k: v
            for k, v in config.to_dict().items()
            if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")
        }
        self.digest = canonical_digest(
            self.kind,
            json.dumps(config_dict, sort_keys=True, separators=(",", ":"), default=str),
            self.model.state_dict(),
        )
        self.tokenizer_digest = canonical_json_digest(
            {
                "tokenizer": json.loads(self.tokenizer.backend_tokenizer.to_str())
                if getattr(self.tokenizer, "is_fast", False)
                else self.tokenizer.get_vocab(),
                "special": {k: str(v) for k, v in self.tokenizer.special_tokens_map.items()},
            }
        )
        self._sessions: dict[bytes, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))


    @torch.no_grad()
    def score(self, items: Sequence[tuple[bytes, Sequence[int]]]) -> torch.Tensor:
        check_distinct_sessions(items)
        if not items:
            return torch.empty(0, self.vocab_size)
        seqs, firsts = [], []
        for session, x in items:
            c = self._get(session)
            full = c + check_tokens(x, self.vocab_size, "proposal")
            self._check_length(len(full))
            seqs.append(full)
            firsts.append(len(c) - 1)
        width = max(len(s) for s in seqs)
        if width * len(seqs) > self.max_batch_tokens:
            raise KVCapacityError(
                f"batch of {len(seqs)} x {width} positions exceeds max_batch_tokens="
                f"{self.max_batch_tokens}"
            )
        pad_id = 0
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):  # left padding: every sequence ends at column width-1
            ids[b, width - len(s) :] = torch.tensor(s)
            mask[b, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        rows = [
            logits[b, width - len(s) + first :]
            for b, (s, first) in enumerate(zip(seqs, firsts, strict=True))
        ]
        return torch.cat(rows).float()







