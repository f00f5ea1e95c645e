"""A small GPT-style decoder in plain torch (LLaMA layout: RMSNorm, RoPE, SwiGLU).

Two entry points share the same weights:

* `Transformer.forward_train(tokens)` — a dense causal forward for training.
* `Transformer.forward_cached(batch: RaggedBatch)` — the backend's ragged batched forward:
  the new tokens of many sequences are packed back to back (no padding); each sequence has its
  own cached past of any length. New token i of a sequence with `past` cached positions
  attends to keys 0..past+i of that sequence only.

Attention is computed per sequence over views of its own KV buffer (no padding, no copies of
the past); everything else runs once over the packed tokens. See `tiny.py` for the cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 768
    max_seq_len: int = 4096  # positions the RoPE table covers: the per-session KV length cap
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_json(self) -> str:
        # Canonical: sorted keys, no whitespace; it is hashed into the model digest.
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        cfg = cls(**d)
        if cfg.d_model % cfg.n_head:
            raise ValueError("d_model must be a multiple of n_head")
        return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_table(cfg: ModelConfig) -> torch.Tensor:
    """cos/sin table, shape [max_seq_len, head_dim // 2, 2]."""
    half = cfg.head_dim // 2
    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, Dh]; rope: [B, T, Dh/2, 2] (already gathered at each token's position)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, None, :, :, 0], rope[:, None, :, :, 1]
    out = torch.stack(
        [xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1
    )
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def qkv(self, x: torch.Tensor, rope: torch.Tensor):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split(self.n_head * self.head_dim, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        return apply_rope(q, rope), apply_rope(k, rope), v

    def out(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Not a parameter: derived from the config, so not part of the weights file.
        self.register_buffer("rope", rope_table(cfg), persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style init; residual projections scaled by depth."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
            with torch.no_grad():
                p.normal_(0.0, std, generator=generator)

    # -- training: dense causal forward ---------------------------------------------------------
    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V]."""
        b, t = tokens.shape
        rope = self.rope[:t].expand(b, t, *self.rope.shape[1:])
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            q, k, v = layer.attention.qkv(layer.attention_norm(x), rope)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer.attention.out(y)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        return self.output(self.norm(x))

    # -- inference: packed ragged batch over per-sequence KV buffers ---------------------------
    def forward_cached(self, batch: RaggedBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] for the packed new tokens (or [len(rows), V] for the packed rows
        `rows` only: a prefill needs its last row, and the head can cost as much as the
        layers); writes the K/V of all T tokens into the caches in place.

        The projections, MLPs and the output head run once over all packed tokens of all
        sequences (no padding); attention runs per sequence over a view of its own buffer,
        so no past K/V is ever copied.
        """
        rope = self.rope[batch.positions][None]  # [1, T, Dh/2, 2]
        x = self.tok_embeddings(batch.tokens)[None]  # [1, T, D]
        masks = [
            causal_offset_mask(past, batch.starts[b + 1] - batch.starts[b], x.device)
            for b, past in enumerate(batch.past_lengths)
        ]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention.qkv(layer.attention_norm(x), rope)  # [1, H, T, Dh] each
            outs = []
            for b, cache in enumerate(batch.caches):
                lo, hi = batch.starts[b], batch.starts[b + 1]
                past, new = batch.past_lengths[b], hi - lo
                cache[i, 0, :, past : past + new] = k[0, :, lo:hi]
                cache[i, 1, :, past : past + new] = v[0, :, lo:hi]
                keys = cache[i, 0, :, : past + new][None]  # [1, H, past+new, Dh], a view
                values = cache[i, 1, :, : past + new][None]
                outs.append(
                    F.scaled_dot_product_attention(q[:, :, lo:hi], keys, values, attn_mask=masks[b])
                )
            x = x + layer.attention.out(torch.cat(outs, dim=2))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        if rows is not None:
            x = x[:, rows]
        return self.output(self.norm(x))[0]


@dataclass(frozen=True)
class RaggedBatch:
    tokens: torch.Tensor  # [T] int64: new tokens of all sequences, packed back to back
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    starts: list[int]  # B + 1 offsets: sequence b owns packed rows starts[b]:starts[b+1]
    past_lengths: list[int]  # B: cached positions each sequence already holds
    caches: list[torch.Tensor]  # B x [n_layer, 2, H, capacity, Dh], capacity >= past + new


def causal_offset_mask(past: int, new: int, device=None) -> torch.Tensor | None:
    """[new, past + new] bool: new query i sees keys 0..past+i. None when new == 1 (sees all)."""
    if new == 1:
        return None
    keys = torch.arange(past + new, device=device)
    return keys[None, :] <= (past + torch.arange(new, device=device))[:, None]
