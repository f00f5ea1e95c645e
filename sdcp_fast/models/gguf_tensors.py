"""Tensors of a GGUF file, dequantised to fp32, for drafts built from the target's own
weights (the distilled draft's embedding, an early-exit draft's first layers).

Reading a GGUF with the `gguf` package parses every metadata entry in Python (about 20 s
for SmolLM2's vocabulary on an idle 2-core machine, a minute on a busy one), so each tensor
asked for is kept, dequantised, in `$SDCP_CACHE/gguf-tensors/<SHA-256 of the file>/` as one
safetensors file per tensor; later loads are memory maps. A cached file that does not load
is rebuilt. The names are llama.cpp's (`token_embd.weight`, `blk.0.attn_q.weight`, ...) and
so is the layout: q/k rows stay in llama.cpp's order, where each head's rotary pairs are
adjacent, which is the order `gpt.apply_rope` rotates (transformers' Llama instead splits
each head in halves and un-permutes on load).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .real_tokenizer import cache_dir, ensure_dir, file_sha256


def gguf_tensors(path: Path, names: Iterable[str], sha256: str | None = None) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor in PyTorch's [out, in] order} for the named tensors of a GGUF."""
    names = list(names)
    folder = cache_dir() / "gguf-tensors" / (sha256 or file_sha256(path))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        f = folder / f"{name}.safetensors"
        if f.is_file():
            try:
                out[name] = load_file(str(f))[name]
            except (SafetensorError, OSError, KeyError):
                f.unlink(missing_ok=True)
    missing = [n for n in names if n not in out]
    if missing:
        fresh = _dequantise(path, missing)
        ensure_dir(folder)
        for name, t in fresh.items():
            tmp = folder / f".{name}.tmp"
            save_file({name: t}, str(tmp))
            tmp.replace(folder / f"{name}.safetensors")
        out.update(fresh)
    return out


def gguf_metadata(path: Path, keys: Iterable[str]) -> dict[str, object]:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {k: fields[k].contents() for k in keys}


def dequantised(tensor) -> torch.Tensor:
    """One tensor of a `gguf.GGUFReader` as fp32, in PyTorch's [out, in] order."""
    import numpy as np
    from gguf.quants import dequantize

    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a writable copy
    shape = [int(s) for s in reversed(tensor.shape)]  # ggml lists dimensions innermost first
    return torch.from_numpy(values.reshape(shape))


def _dequantise(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    unknown = [n for n in names if n not in tensors]
    if unknown:
        raise KeyError(f"{path.name}: no tensors {unknown}")
    return {name: dequantised(tensors[name]) for name in names}
