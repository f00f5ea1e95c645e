"""`hf:FILE.gguf`: a tiny GGUF written here with the `gguf` package loads, scores like the
model it came from, is converted once into $SDCP_CACHE, and a damaged copy is rebuilt."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from hf_helpers import bpe_tokenizer, tiny_llama, write_gguf  # noqa: E402

from sdcp_fast.models import gguf_cache, load_backend  # noqa: E402
from sdcp_fast.models.gguf_cache import MANIFEST  # noqa: E402
from sdcp_fast.models.real_tokenizer import cache_dir, file_sha256  # noqa: E402


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """SDCP_CACHE in tmp_path; counts conversions."""
    monkeypatch.setenv("SDCP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []
    real = gguf_cache.build

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(gguf_cache, "build", counting)
    return calls


def test_gguf_loads_scores_like_its_source_and_converts_once(tmp_path, builds):
    source = tiny_llama(seed=3)
    path = write_gguf(source, tmp_path / "tiny.gguf")
    be = load_backend(f"hf:{path}")
    assert len(builds) == 1
    entry = cache_dir() / "gguf" / file_sha256(path)
    assert json.loads((entry / MANIFEST).read_text())["source"] == "tiny.gguf"
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())

    prompt = bpe_tokenizer().encode("ab ac ad", add_special_tokens=False)
    assert be.encode("ab ac ad") == prompt and be.decode(prompt) == "ab ac ad"
    be.open(b"s", prompt)
    out = be.score([(b"s", [7, 8, 9])])
    with torch.no_grad():
        expected = source(input_ids=torch.tensor([prompt + [7, 8, 9]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    assert torch.equal(out.argmax(-1), expected.argmax(-1))

    again = load_backend(f"hf:{path}")
    assert len(builds) == 1  # the converted copy was reused, not converted again
    assert again.digest == be.digest and again.tokenizer_digest == be.tokenizer_digest
    assert load_backend(f"hf:{entry}").digest == be.digest  # the copy itself: same digest


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "no manifest", "missing file"])
def test_damaged_copy_is_rebuilt_not_trusted(tmp_path, builds, damage):
    path = write_gguf(tiny_llama(seed=4), tmp_path / "tiny.gguf")
    digest = load_backend(f"hf:{path}").digest
    entry = cache_dir() / "gguf" / file_sha256(path)
    weights = entry / "model.safetensors"
    data = weights.read_bytes()
    if damage == "flipped byte":  # same size, one weight changed
        weights.write_bytes(data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "no manifest":
        (entry / MANIFEST).unlink()
    else:
        (entry / "tokenizer.json").unlink()
    assert gguf_cache.entry_problem(entry, file_sha256(path)) is not None
    be = load_backend(f"hf:{path}")
    assert len(builds) == 2
    assert be.digest == digest
    assert gguf_cache.entry_problem(entry, file_sha256(path)) is None


def test_missing_gguf_file(tmp_path, builds):
    with pytest.raises(FileNotFoundError):
        load_backend(f"hf:{tmp_path / 'absent.gguf'}")
    assert builds == []
