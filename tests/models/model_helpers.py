"""Helpers shared by the model tests (a unique module name: tests run in rootdir-prepend mode)."""

from __future__ import annotations

import torch

from sdcp_fast.models.gpt import ModelConfig, Transformer

SMALL = ModelConfig(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=128)


def random_model(cfg: ModelConfig = SMALL, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # larger weights: peaked, position-sensitive logits, so bugs show
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)
    return model.eval()
