"""The Hugging Face backend, with a tiny GPT-2 and a word-level tokenizer built here.

No download: HF_HUB_OFFLINE=1 and everything is loaded from tmp_path.
Tolerance: atol 1e-5, rtol 1e-5 between the left-padded batch and unpadded single runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from sdcp_fast.models import KVCapacityError, KVImportError, load_backend  # noqa: E402

WORDS = ["[UNK]", "[PAD]"] + [f"w{i}" for i in range(30)]
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(WORDS), n_layer=1, n_embd=32, n_head=2, n_positions=64
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def reference(model, committed, proposal):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([committed + proposal])).logits[0]
    return logits[len(committed) - 1 :]


def test_batched_scoring_matches_unpadded_single_runs(hf_dir):
    be = load_backend(f"hf:{hf_dir}")
    assert be.vocab_size == len(WORDS)
    prompts = {b"a": be.encode("w1 w2 w3 w4 w5"), b"b": be.encode("w9"), b"c": [5, 6, 7]}
    assert prompts[b"a"] == [3, 4, 5, 6, 7]
    proposals = {b"a": [8, 9], b"b": [], b"c": [10, 11, 12, 13, 14, 15]}
    for sid, p in prompts.items():
        be.open(sid, p)
    out = be.score(list(proposals.items()))
    assert out.shape == (2 + 1 + 1 + 7, len(WORDS)) and out.dtype == torch.float32
    row = 0
    for sid, x in proposals.items():
        torch.testing.assert_close(
            out[row : row + len(x) + 1], reference(be.model, prompts[sid], x), **TOL
        )
        row += len(x) + 1


def test_commit_export_import_and_text(hf_dir):
    # transformers' own linear layers: bit-equal passes whatever each backend ran before
    be = load_backend(f"hf:{hf_dir}?linear=library")
    be.open(b"a", [3, 4, 5])
    be.score([(b"a", [6, 7])])
    be.commit(b"a", [6, 20])
    assert be.committed(b"a") == [3, 4, 5, 6, 20]
    other = load_backend(f"hf:{hf_dir}?linear=library")
    other.import_kv(b"z", be.export_kv(b"a"))
    assert torch.equal(other.score([(b"z", [1])]), be.score([(b"a", [1])]))
    torch.testing.assert_close(
        be.score([(b"a", [1])]), reference(be.model, [3, 4, 5, 6, 20], [1]), **TOL
    )
    assert be.decode([3, 4, 5]) == "w1 w2 w3"
    tiny_blob = b"SDCPKV1\n" + b"\0" * 40
    with pytest.raises(KVImportError):
        other.import_kv(b"y", tiny_blob)
    with pytest.raises(KVCapacityError):
        be.open(b"long", [3] * 65)  # n_positions = 64


def test_digests_stable_across_loads_and_processes(hf_dir):
    a, b = load_backend(f"hf:{hf_dir}"), load_backend(f"hf:{hf_dir}")
    assert a.digest == b.digest and a.tokenizer_digest == b.tokenizer_digest
    code = (
        "import sys; from sdcp_fast.models import load_backend; "
        "b = load_backend('hf:' + sys.argv[1]); print(b.digest.hex(), b.tokenizer_digest.hex())"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code, str(hf_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    ).stdout.split()
    assert out == [a.digest.hex(), a.tokenizer_digest.hex()]
    with torch.no_grad():
        a.model.transformer.h[0].mlp.c_fc.weight[0, 0] += 1.0
    a.model.save_pretrained(hf_dir)
    assert load_backend(f"hf:{hf_dir}").digest != b.digest
