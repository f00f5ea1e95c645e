"""`load_backend(spec)`: resolve a model spec from a config to a backend.

    tiny:demo-target | tiny:demo-draft   the shipped demo pair (files in sdcp_fast/models/demo)
    tiny:PATH      a built-in model file (safetensors + config metadata); a tokenizer.json
                   next to it is used if present, else the byte tokenizer
    table:PATH     a [V, V] table model (see table.py)
    hf:PATH        a transformers causal LM + tokenizer from a local directory or a .gguf
                   file (lazy import; options dtype, device, threads, max_kv_bytes,
                   max_seq_len: see hf.py)
    replay:PATH    a benchmark draft that plays back recorded continuations (replay.py)

A spec may carry options after `?` (`hf:PATH?dtype=bfloat16&threads=2`); each kind lists the
ones it knows and refuses the rest (spec.py). Keyword options go to the backend's
constructor (e.g. max_kv_bytes for tiny).
"""

from __future__ import annotations

from pathlib import Path

from .base import Backend, BackendSpecError
from .spec import ModelSpec, parse_spec, spec_options

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_MODELS = {"demo-target": "demo-target.safetensors", "demo-draft": "demo-draft.safetensors"}


def _tiny(spec: ModelSpec, **kw) -> Backend:
    from .tiny import TinyBackend

    spec_options(spec, {})
    path = DEMO_DIR / DEMO_MODELS[spec.arg] if spec.arg in DEMO_MODELS else Path(spec.arg)
    tok = path.parent / "tokenizer.json"
    return TinyBackend.from_file(path, tok if tok.is_file() else None, **kw)


def _table(spec: ModelSpec, **kw) -> Backend:
    from .table import TableBackend

    spec_options(spec, {})
    return TableBackend.from_file(spec.arg, **kw)


def _hf(spec: ModelSpec, **kw) -> Backend:
    from .hf import SPEC_OPTIONS, HFBackend  # transformers is imported only here

    return HFBackend(spec.arg, **spec_options(spec, SPEC_OPTIONS), **kw)


def _replay(spec: ModelSpec, **kw) -> Backend:
    from .replay import ReplayBackend

    spec_options(spec, {})
    return ReplayBackend.from_file(spec.arg, **kw)


# One entry per kind: the function that builds its backend from the parsed spec.
KINDS = {"tiny": _tiny, "table": _table, "hf": _hf, "replay": _replay}


def load_backend(spec: str, **options) -> Backend:
    parsed = parse_spec(spec)
    build = KINDS.get(parsed.kind)
    if build is None:
        raise BackendSpecError(
            f"unknown model kind {parsed.kind!r} in {spec!r} ({', '.join(KINDS)})"
        )
    return build(parsed, **options)
