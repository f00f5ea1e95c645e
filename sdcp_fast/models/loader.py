"""`load_backend(spec)`: resolve a model spec from a config to a backend.

    tiny:demo-target | tiny:demo-draft   the shipped demo pair (files in sdcp_fast/models/demo)
    tiny:PATH      a built-in model file (safetensors + config metadata); a tokenizer.json
                   next to it is used if present, else the byte tokenizer
    table:PATH     a [V, V] table model (see table.py)
    hf:SOURCE      a transformers causal LM + tokenizer: a local directory, a .gguf file or
                   `smollm2` (lazy import; options dtype, device, threads, max_kv_bytes,
                   max_seq_len: see hf.py)
    gguf:SOURCE    the target's GGUF run by llama.cpp, a draft (llamacpp.py; [real] extra)
    twin:SOURCE    the target's GGUF run by the native int8 decoder, a draft (twin.py)
    ngram:TOKENIZER  prompt-lookup drafting, no model (ngram.py)
    distilled:NAME   a draft on the target's GGUF: trained, or its first layers (distilled.py)
    replay:PATH    a benchmark draft that plays back recorded continuations (replay.py)

Options follow `?` (`hf:PATH?dtype=bfloat16&threads=2`); each kind reads the ones it knows
with `spec_options.split_options`, which refuses the others naming the known ones. Keyword
options go to the backend's constructor (e.g. max_kv_bytes for tiny).
"""

from __future__ import annotations

from pathlib import Path

from .base import Backend, BackendSpecError
from .spec_options import split_options

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_MODELS = {"demo-target": "demo-target.safetensors", "demo-draft": "demo-draft.safetensors"}


def _tiny(arg: str, **options) -> Backend:
    from .tiny import TinyBackend

    arg, _ = split_options(arg, {}, "tiny")
    path = DEMO_DIR / DEMO_MODELS[arg] if arg in DEMO_MODELS else Path(arg)
    tok = path.parent / "tokenizer.json"
    return TinyBackend.from_file(path, tok if tok.is_file() else None, **options)


def _table(arg: str, **options) -> Backend:
    from .table import TableBackend

    arg, _ = split_options(arg, {}, "table")
    return TableBackend.from_file(arg, **options)


def _hf(arg: str, **options) -> Backend:
    from .hf import HFBackend  # transformers is imported only here

    return HFBackend.from_spec(arg, **options)


def _gguf(arg: str, **options) -> Backend:
    from .llamacpp import LlamaCppBackend  # llama-cpp-python is imported only here

    return LlamaCppBackend.from_spec(arg, **options)


def _twin(arg: str, **options) -> Backend:
    from .twin import TwinBackend  # the native int8 decoder (csrc/cpu/twin_cpu.cpp)

    return TwinBackend.from_spec(arg, **options)


def _ngram(arg: str, **options) -> Backend:
    from .ngram import NgramBackend

    return NgramBackend.from_spec(arg, **options)


def _distilled(arg: str, **options) -> Backend:
    from .distilled import load_distilled

    return load_distilled(arg, **options)


def _replay(arg: str, **options) -> Backend:
    from .replay import ReplayBackend

    arg, _ = split_options(arg, {}, "replay")
    return ReplayBackend.from_file(arg, **options)


# One entry per kind: the function that builds its backend from the spec's argument.
KINDS = {
    "tiny": _tiny,
    "table": _table,
    "hf": _hf,
    "gguf": _gguf,
    "twin": _twin,
    "ngram": _ngram,
    "distilled": _distilled,
    "replay": _replay,
}


def load_backend(spec: str, **options) -> Backend:
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise BackendSpecError(f"model spec must be KIND:ARG, got {spec!r}")
    build = KINDS.get(kind)
    if build is None:
        raise BackendSpecError(f"unknown model kind {kind!r} in {spec!r} ({', '.join(KINDS)})")
    return build(arg, **options)
