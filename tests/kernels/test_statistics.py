"""Statistical exactness of rule 2 on the CPU paths (kernels/cpu.py and the native op), and the
power to catch a wrong rule.

For fixed target rows p[1..M+1] and draft rows q[1..M], every trial is one proposal (tokens
drawn from q, fresh uniforms); all trials go through the path under test as large batches. The
committed token at position j (present when a >= j - 1) must follow p[j]: a chi-square test
per position with p-value threshold ALPHA. A deliberately wrong rule (the extra token after a
rejection drawn from p instead of the residual max(0, p - q)) must fail the same test, and the
test's computed power against it is checked to be at least MIN_POWER.
"""

import pytest
import torch
from kernel_cases import require_native
from scipy import stats
from sdcp_fast.kernels import VerifyBatch, build_batch, verify
from sdcp_fast.kernels.batch import ProposalInput
from sdcp_fast.kernels.reference import target_row

ALPHA = 1e-4  # per-position p-value threshold (fixed seeds: the outcome is deterministic)
MIN_POWER = 0.999  # required power of the test against the wrong residual rule
CHUNK = 20_000  # proposals per verify call (bounded memory)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """p-value and degrees of freedom; tokens with p = 0 must never occur, bins with an
    expected count under 5 are merged into one."""
    assert int(counts[probs == 0].sum()) == 0, "a token outside the support was committed"
    n = int(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big & (probs > 0)].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = int(obs.numel()) - 1
    return float(stats.chi2.sf(statistic, dof)), dof


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cumulative = torch.cumsum(weights, dim=-1)
    return torch.searchsorted(cumulative, (u * cumulative[-1]).contiguous(), right=True)


def run_trials(logits_rows, q_rows, sampling, trials, gen, path):
    """Committed tokens per position (j = 1..M+1), for the kernel's rule and for the wrong
    rule on the same trials (after a rejection, the extra token drawn from p[a+1] with the
    same uniform instead of from the residual)."""
    m, vocab = q_rows.shape
    p_rows = torch.stack([target_row(r, **sampling) for r in logits_rows])
    right = [[] for _ in range(m + 1)]
    wrong = [[] for _ in range(m + 1)]
    done = 0
    while done < trials:
        n = min(CHUNK, trials - done)
        tokens = torch.stack([torch.multinomial(q_rows[i].double(), n, replacement=True, generator=gen)
                              for i in range(m)], dim=1)  # [n, M]
        acc_u = torch.rand(n, m, generator=gen, dtype=torch.float64)
        extra_u = torch.rand(n, m + 1, generator=gen, dtype=torch.float64)
        batch = _trial_batch(logits_rows, q_rows, sampling, tokens, acc_u, extra_u)
        res = verify(batch, path=path)
        assert not bool(res.bad_q.any() or res.nan_logits.any())
        accepted, extra = res.accepted, res.extra_token
        rejected = accepted < m
        cumulative = torch.cumsum(p_rows[accepted[rejected]], dim=-1)
        target = extra_u[rejected, accepted[rejected]] * cumulative[:, -1]
        extra_wrong = extra.clone()
        extra_wrong[rejected] = (cumulative <= target[:, None]).sum(dim=1)
        for j in range(m + 1):  # position j + 1 is committed when a >= j
            reached = accepted >= j
            drafted = accepted[reached] > j
            draft_tok = tokens[reached][:, min(j, m - 1)]
            right[j].append(torch.where(drafted, draft_tok, extra[reached]))
            wrong[j].append(torch.where(drafted, draft_tok, extra_wrong[reached]))
        done += n
    return [torch.cat(t) for t in right], [torch.cat(t) for t in wrong], p_rows


def _trial_batch(logits_rows, q_rows, sampling, tokens, acc_u, extra_u) -> VerifyBatch:
    n, m = tokens.shape
    logits = logits_rows.repeat(n, 1)
    q = q_rows.repeat(n, 1)
    one = build_batch(logits_rows, [ProposalInput(rule=2, tokens=[0] * m, accept_uniforms=[0.0] * m,
                                                  extra_uniforms=0.0, sampling=sampling)], q_rows)
    # the same layout n times, built as tensors directly (a Python list of 100k inputs is slow)
    b = torch.arange(n)
    return VerifyBatch(
        logits=logits, draft_tokens=tokens.reshape(-1), num_draft=one.num_draft.repeat(n),
        rule=one.rule.repeat(n), temperature_milli=one.temperature_milli.repeat(n),
        top_k=one.top_k.repeat(n), top_p_milli=one.top_p_milli.repeat(n), q=q,
        q_start=b * m, accept_uniforms=acc_u.reshape(-1), extra_uniforms=extra_u.reshape(-1),
        row_start=b * (m + 1), token_start=b * m)


def wrong_rule_power(p1: torch.Tensor, q1: torch.Tensor, trials: int, dof: int) -> float:
    """Power of the position-1 chi-square test against the wrong residual rule."""
    wrong = torch.minimum(p1, q1) + (1 - torch.minimum(p1, q1).sum()) * p1
    support = p1 > 0
    noncentrality = trials * float(((wrong - p1)[support] ** 2 / p1[support]).sum())
    critical = stats.chi2.isf(ALPHA, dof)
    return float(stats.ncx2.sf(critical, dof, noncentrality))


CASES = [
    # (vocab, M, sampling, trials)
    (50, 3, {"temperature_milli": 1000, "top_k": 0, "top_p_milli": 1000}, 200_000),
    (200, 2, {"temperature_milli": 700, "top_k": 40, "top_p_milli": 900}, 100_000),
    (1000, 1, {"temperature_milli": 1300, "top_k": 0, "top_p_milli": 1000}, 100_000),
]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["cpu", "native"])
@pytest.mark.parametrize("vocab,m,sampling,trials", CASES)
def test_committed_tokens_follow_target(vocab, m, sampling, trials, path):
    if path == "native":
        require_native()
    gen = torch.Generator().manual_seed(vocab)
    logits_rows = torch.randn(m + 1, vocab, generator=gen) * 1.5
    # a draft that disagrees with the target: both rejections and acceptances are common
    q_rows = torch.softmax(logits_rows[:m] * 0.5 + torch.randn(m, vocab, generator=gen), dim=-1)
    committed, wrong, p_rows = run_trials(logits_rows, q_rows, sampling, trials, gen, path)
    for j in range(m + 1):
        counts = torch.bincount(committed[j], minlength=vocab)
        pvalue, dof = chi_square(counts, p_rows[j])
        assert pvalue > ALPHA, f"position {j + 1}: p-value {pvalue:.2e} (dof {dof})"

    # the wrong rule on the same trials must be caught at position 1
    counts = torch.bincount(wrong[0], minlength=vocab)
    pvalue, dof = chi_square(counts, p_rows[0])
    power = wrong_rule_power(p_rows[0], q_rows[0].double(), trials, dof)
    assert power >= MIN_POWER, f"test too weak against the wrong rule: power {power:.4f}"
    assert pvalue < ALPHA, f"the wrong residual rule passed: p-value {pvalue:.2e}"
