"""The shipped demo pair: pinned digests, stable across processes, and a real draft.

The pinned hex values are the SHA-256 canonical digests (weights.canonical_digest) of the
files produced by scripts/train_demo.py; retraining changes them (update them together).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sdcp_fast.models import DEMO_DIR, load_backend

TARGET_DIGEST = "8faf45b203a98a05096ec5566cbb09ed31b2af70d431e8d8a97510d724ad6e7e"
DRAFT_DIGEST = "2eb2897a6ec590edd5bd2b48131c1379951c0c4b49fd86f3567e2eb82d96ff50"
TOKENIZER_DIGEST = "f766c7ab9d4dead69e79d6cfbdce73a0c0f058d226f62e0a2a6ef942c9ca24db"


@pytest.fixture(scope="module")
def pair():
    return load_backend("tiny:demo-target"), load_backend("tiny:demo-draft")


def test_shipped_files_fit_the_budget():
    files = sorted(p.name for p in DEMO_DIR.iterdir() if p.suffix in {".safetensors", ".json"})
    assert files == ["demo-draft.safetensors", "demo-target.safetensors", "tokenizer.json"]
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) <= 10 * 1024 * 1024


def test_pinned_digests(pair):
    target, draft = pair
    assert target.digest.hex() == TARGET_DIGEST
    assert draft.digest.hex() == DRAFT_DIGEST
    assert target.tokenizer_digest.hex() == draft.tokenizer_digest.hex() == TOKENIZER_DIGEST
    assert target.vocab_size == draft.vocab_size == 256


def test_digests_stable_across_processes():
    code = (
        "from sdcp_fast.models import load_backend\n"
        "for s in ('tiny:demo-target', 'tiny:demo-draft'):\n"
        "    b = load_backend(s); print(b.digest.hex(), b.tokenizer_digest.hex())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert out == [TARGET_DIGEST, TOKENIZER_DIGEST, DRAFT_DIGEST, TOKENIZER_DIGEST]


def test_draft_is_smaller_and_agrees_with_the_target_greedily(pair):
    """Deterministic quality floor: on a fixed snippet of Python, the draft's greedy token
    equals the target's on at least 60 % of 64 positions of the target's greedy path."""
    target, draft = pair
    assert draft.model.cfg.n_layer < target.model.cfg.n_layer
    assert draft.model.cfg.d_model < target.model.cfg.d_model
    prompt = target.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")
    target.open(b"q", prompt)
    draft.open(b"q", prompt)
    agree = 0
    for _ in range(64):
        token = int(target.score([(b"q", [])])[0].argmax())
        agree += int(draft.score([(b"q", [])])[0].argmax()) == token
        target.commit(b"q", [token])
        draft.commit(b"q", [token])
    assert agree >= 0.6 * 64
