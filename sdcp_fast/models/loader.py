"""`load_backend(spec)`: resolve a model name from a config to a backend.

    tiny:demo-target | tiny:demo-draft   the shipped demo pair (files in sdcp_fast/models/demo)
    tiny:PATH      a built-in model file (safetensors + config metadata); a tokenizer.json
                   next to it is used if present, else the byte tokenizer
    table:PATH     a [V, V] table model (see table.py)
    hf:PATH        a transformers causal LM + tokenizer from a local directory (lazy import)
    gguf:SOURCE    the target's GGUF run by llama.cpp, a draft (llamacpp.py; [real] extra)
    twin:SOURCE    the target's GGUF run by the native int8 decoder, a draft (twin.py)
    ngram:TOKENIZER  prompt-lookup drafting, no model (ngram.py)
    distilled:NAME   a draft on the target's GGUF: trained, or its first layers (distilled.py)

Keyword options go to the backend's constructor (e.g. max_kv_bytes for tiny).
"""

from __future__ import annotations

from pathlib import Path

from .base import Backend, BackendSpecError

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_MODELS = {"demo-target": "demo-target.safetensors", "demo-draft": "demo-draft.safetensors"}


def load_backend(spec: str, **options) -> Backend:
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise BackendSpecError(f"model spec must be KIND:ARG, got {spec!r}")
    if kind == "tiny":
        from .tiny import TinyBackend

        path = DEMO_DIR / DEMO_MODELS[arg] if arg in DEMO_MODELS else Path(arg)
        tok = path.parent / "tokenizer.json"
        return TinyBackend.from_file(path, tok if tok.is_file() else None, **options)
    if kind == "table":
        from .table import TableBackend

        return TableBackend.from_file(arg, **options)
    if kind == "hf":
        from .hf import HFBackend  # transformers is imported only here

        return HFBackend(arg, **options)
    if kind == "gguf":
        from .llamacpp import LlamaCppBackend  # llama-cpp-python is imported only here

        return LlamaCppBackend.from_spec(arg, **options)
    if kind == "twin":
        from .twin import TwinBackend

        return TwinBackend.from_spec(arg, **options)
    if kind == "ngram":
        from .ngram import NgramBackend

        return NgramBackend.from_spec(arg, **options)
    if kind == "distilled":
        from .distilled import load_distilled

        return load_distilled(arg, **options)
    raise BackendSpecError(
        f"unknown model kind {kind!r} in {spec!r} (tiny, table, hf, gguf, twin, ngram, distilled)"
    )
