"""load_backend specs and the canonical weights digest."""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_model
from safetensors.torch import save_file

from sdcp_fast.models import Backend, BackendSpecError, load_backend
from sdcp_fast.models.spec_options import split_options
from sdcp_fast.models.weights import CONFIG_KEY, canonical_digest, read_safetensors


def test_bad_specs():
    for spec in ["tiny", "tiny:", "nope:x", ""]:
        with pytest.raises(BackendSpecError):
            load_backend(spec)
    with pytest.raises(FileNotFoundError):
        load_backend("tiny:/nonexistent/model.safetensors")
    for spec in ["tiny:demo-target?threads=2", "tiny:demo-target?=1", "nope:x?a=1", "tiny:?a=1"]:
        with pytest.raises(BackendSpecError):
            load_backend(spec)


def test_spec_options_grammar():
    known = {"threads": int, "dtype": str}
    assert split_options("/m/model.gguf?dtype=bfloat16&threads=4", known, "hf") == (
        "/m/model.gguf", {"dtype": "bfloat16", "threads": 4})
    assert split_options("demo-target", {}, "tiny") == ("demo-target", {})
    with pytest.raises(BackendSpecError, match=r"unknown option 'thread' \(known: dtype, threads\)"):
        split_options("y?thread=3", known, "x")
    with pytest.raises(BackendSpecError, match="given twice"):
        split_options("y?threads=1&threads=2", known, "x")
    with pytest.raises(BackendSpecError, match="known: none"):
        split_options("y?threads=1", {}, "x")

def test_backends_satisfy_the_protocol(tiny_path):
    assert isinstance(load_backend(f"tiny:{tiny_path}"), Backend)


def test_tiny_file_without_config_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a tiny model"):
        load_backend(f"tiny:{path}")


def test_digest_ignores_file_layout_but_not_content(tiny_path, tmp_path):
    tensors, meta = read_safetensors(tiny_path)
    base = load_backend(f"tiny:{tiny_path}").digest
    # Same tensors, inserted in reverse order, extra metadata: same digest.
    relaid = tmp_path / "relaid.safetensors"
    save_file(dict(reversed(list(tensors.items()))), str(relaid), metadata={**meta, "note": "x"})
    assert load_backend(f"tiny:{relaid}").digest == base
    # One weight changed by one ulp: a different digest.
    changed = dict(tensors)
    w = changed["output.weight"].clone()
    w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1e9))
    changed["output.weight"] = w
    other = tmp_path / "changed.safetensors"
    save_file(changed, str(other), metadata=meta)
    assert load_backend(f"tiny:{other}").digest != base


def test_digest_definition_is_pinned():
    """The serialisation itself, pinned on a 2-tensor example (any change breaks contracts)."""
    tensors = {
        "b": torch.tensor([1.0, -2.0], dtype=torch.float16),
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }
    import hashlib

    expect = hashlib.sha256(
        b"sdcp-fast/weights/v1\nkind\n{}\n"
        + b"a\nfloat32\n2,3\n"
        + torch.arange(6, dtype=torch.float32).numpy().tobytes()
        + b"b\nfloat16\n2\n"
        + bytes.fromhex("003c00c0")
    ).digest()
    assert canonical_digest("kind", "{}", tensors) == expect


def test_config_is_part_of_the_digest(tmp_path):
    from sdcp_fast.models.weights import save_tiny

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    model = random_model()
    save_tiny(model, a)
    tensors, meta = read_safetensors(a)
    cfg = meta[CONFIG_KEY].replace('"rope_base":10000.0', '"rope_base":500.0')
    assert cfg != meta[CONFIG_KEY]
    save_file(tensors, str(b), metadata={CONFIG_KEY: cfg})
    assert load_backend(f"tiny:{a}").digest != load_backend(f"tiny:{b}").digest
