"""Weights files and their canonical digest.

A built-in ("tiny") model is one safetensors file: the tensors (fp16 or fp32) plus the model
config as canonical JSON under the metadata key ``sdcp.config``.

The digest (the contract's ``target``) must not depend on how a file happens to be laid out
(safetensors header order, padding, metadata), only on what the model computes. So it is the
SHA-256 of a canonical serialisation:

    b"sdcp-fast/weights/v1\\n" + kind + b"\\n" + canonical config JSON + b"\\n"
    then, for each tensor in sorted name order:
        name, dtype name, shape (as decimal text, joined by ","), each followed by b"\\n",
        then the tensor's raw little-endian bytes in its stored dtype (C order).

Integers and lengths are text and every field is newline-terminated, and names cannot
contain newlines (checked), so the serialisation is injective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .gpt import ModelConfig, Transformer

CONFIG_KEY = "sdcp.config"


def canonical_digest(kind: str, config_json: str, tensors: Mapping[str, torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    h.update(b"sdcp-fast/weights/v1\n" + kind.encode() + b"\n" + config_json.encode() + b"\n")
    for name in sorted(tensors):
        if "\n" in name:
            raise ValueError(f"tensor name with a newline: {name!r}")
        t = tensors[name].detach().cpu().contiguous()
        shape = ",".join(str(s) for s in t.shape)
        h.update(f"{name}\n{str(t.dtype).removeprefix('torch.')}\n{shape}\n".encode())
        # view as bytes: the host is little-endian on every platform torch supports here
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def save_tiny(model: Transformer, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in model.state_dict().items()}
    save_file(tensors, str(path), metadata={CONFIG_KEY: model.cfg.to_json()})


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors in their stored dtype, metadata)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return tensors, meta


def load_tiny(path: str | Path) -> tuple[Transformer, bytes]:
    """Load a built-in model (fp32, eval mode) and its canonical digest."""
    import json

    tensors, meta = read_safetensors(path)
    if CONFIG_KEY not in meta:
        raise ValueError(f"{path}: not a tiny model file (no {CONFIG_KEY!r} metadata)")
    cfg = ModelConfig.from_dict(json.loads(meta[CONFIG_KEY]))
    model = Transformer(cfg)
    model.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)
    model.eval().requires_grad_(False)
    return model, canonical_digest("tiny", cfg.to_json(), tensors)
