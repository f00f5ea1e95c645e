"""Hand-computed answers and edge cases: exact values, field by field, on every path."""

import math

import pytest
import torch
from kernel_cases import mixed_batch
from sdcp_fast.kernels import ProposalInput, VerifyInputError, build_batch, verify


def run(target, logits, proposals, q=None):
    device, impl = target
    batch = build_batch(logits.to(device), proposals, None if q is None else q.to(device))
    ref = verify(batch, path="reference").rows()
    got = verify(batch, path=impl).rows()
    assert got == ref
    return got


def log_probs(*ps: float) -> list[float]:
    return [math.log(p) for p in ps]


def test_hand_computed_rule2_residual(target):
    # p = (0.1, 0.2, 0.3, 0.4) at every row, q uniform: x1 = 3 is always accepted
    # (p/q = 1.6), x2 = 0 has p/q = 0.4 and r = 0.5 rejects it. Residual max(0, p - q) =
    # (0, 0, 0.05, 0.15): u = 0.3 -> 0.06 of 0.2 -> token 3; u = 0.2 -> 0.04 -> token 2.
    logits = torch.tensor([log_probs(0.1, 0.2, 0.3, 0.4)] * 6)
    q = torch.full((4, 4), 0.25)
    # the extra uniform is the one for i = a + 1 = 2; the others would give token 3 / 2
    props = [ProposalInput(rule=2, tokens=[3, 0], accept_uniforms=[0.99, 0.5],
                           extra_uniforms=[1 - u, u, 1 - u]) for u in (0.3, 0.2)]
    assert run(target, logits, props, q) == [(1, 3, False, False), (1, 2, False, False)]
    # r = 0.39 < 0.4 accepts x2 too; the extra token then comes from p (u = 0.35 -> token 2)
    props = [ProposalInput(rule=2, tokens=[3, 0], accept_uniforms=[0.0, 0.39], extra_uniforms=0.35)]
    assert run(target, logits[:3], props, q[:2]) == [(2, 2, False, False)]


def test_hand_computed_rule1(target):
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0, 1.0], [0.0, 1.0, 3.0], [4.0, 0.0, 4.0]])
    # argmax per row: 1, 0 (tie -> smaller id), 2, 0 (tie)
    props = [ProposalInput(rule=1, tokens=[1, 0, 1], accept_uniforms=[0.5] * 3, extra_uniforms=0.5)]
    assert run(target, logits, props) == [(2, 2, False, False)]
    props = [ProposalInput(rule=1, tokens=[1, 0, 2], accept_uniforms=[0.5] * 3, extra_uniforms=0.5,
                           sampling={"temperature_milli": 300, "top_k": 2, "top_p_milli": 100})]
    assert run(target, logits, props) == [(3, 0, False, False)]


def test_empty_residual_falls_back_to_p(target):
    # q = 1.5 p everywhere: p/q = 2/3 and r = 0.9 rejects; max(0, p - q) has no mass, so the
    # extra token is drawn from p: u = 0.5 -> cumsum (0.1, 0.3, 0.6) > 0.5 -> token 2.
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = torch.log(p).float().expand(2, 4).contiguous()
    q = (1.5 * p).float()[None]
    props = [ProposalInput(rule=2, tokens=[1], accept_uniforms=[0.9], extra_uniforms=0.5)]
    assert run(target, logits, props, q) == [(0, 2, False, False)]


def test_greedy_rule2(target):
    logits = torch.tensor([[0.0, 3.0, 1.0]] * 3)
    q = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.2, 0.3]])
    props = [ProposalInput(rule=2, tokens=[1, 0], accept_uniforms=[0.999, 0.0], extra_uniforms=0.9,
                           sampling={"temperature_milli": 0})]
    # x1 = argmax: p(x) = 1, accepted for any r; x2 != argmax: p(x) = 0, rejected even at r = 0
    assert run(target, logits, props, q) == [(1, 1, False, False)]


@pytest.mark.parametrize("bad_value", [0.0, -0.25, float("nan"), float("inf")])
def test_bad_q_refuses_only_that_proposal(target, bad_value):
    gen = torch.Generator().manual_seed(3)
    device, impl = target
    batch = mixed_batch(gen, 300, [3, 2, 4], torch.float32, device, rules=[2, 2, 1])
    clean = verify(batch, path=impl).rows()
    q = batch.q.clone()
    x = int(batch.draft_tokens[int(batch.token_start[1]) + 1])
    q[int(batch.q_start[1]) + 1, x] = bad_value
    broken = build_batch(batch.logits, _inputs(batch), q)
    got = verify(broken, path=impl).rows()
    assert got[1] == (0, -1, True, False)
    assert got[0] == clean[0] and got[2] == clean[2]


@pytest.mark.parametrize("poison", ["nan", "+inf", "all -inf"])
def test_bad_logits_flag_only_that_proposal(target, poison):
    gen = torch.Generator().manual_seed(4)
    device, impl = target
    batch = mixed_batch(gen, 300, [2, 3, 1], torch.bfloat16, device, rules=[2, 1, 2])
    clean = verify(batch, path=impl).rows()
    logits = batch.logits.clone()
    row = int(batch.row_start[1]) + 3  # the last row of proposal 1 (the all-accepted row)
    if poison == "nan":
        logits[row, 17] = float("nan")
    elif poison == "+inf":
        logits[row, 17] = float("inf")
    else:
        logits[row] = float("-inf")
    got = verify(build_batch(logits, _inputs(batch), batch.q), path=impl).rows()
    assert got[1] == (0, -1, False, True)
    assert got[0] == clean[0] and got[2] == clean[2]


def test_minus_inf_logits_are_masked_tokens(target):
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]] * 2)
    props = [ProposalInput(rule=2, tokens=[0], accept_uniforms=[0.99], extra_uniforms=0.999)]
    q = torch.tensor([[0.97, 0.01, 0.01, 0.01]])
    # p = softmax(0, 1) on ids 0 and 2; p(0)/q(0) < 0.99 -> rejected; residual only on id 2
    assert run(target, logits, props, q) == [(0, 2, False, False)]


def test_m_64_all_accepted(target):
    device, impl = target
    gen = torch.Generator().manual_seed(64)
    vocab = 300
    logits = torch.randn(65 * 2, vocab, generator=gen)
    p = torch.softmax(logits[:64].double(), -1)
    q = p.float()  # q == p: every ratio is 1 (up to rounding) and r < 1 accepts
    tokens2 = torch.multinomial(p, 1, generator=gen)[:, 0].tolist()
    tokens1 = logits[65:129].argmax(-1).tolist()
    props = [ProposalInput(rule=2, tokens=tokens2, accept_uniforms=[0.5] * 64, extra_uniforms=0.5),
             ProposalInput(rule=1, tokens=tokens1, accept_uniforms=[0.5] * 64, extra_uniforms=0.5)]
    got = run(target, logits, props, q)
    assert [g[0] for g in got] == [64, 64]
    assert got[1][1] == int(logits[129].argmax())


def test_q_rows_at_arbitrary_offsets(target):
    """The cache loader may land rule-2 rows anywhere in one preallocated tensor."""
    device, impl = target
    gen = torch.Generator().manual_seed(9)
    batch = mixed_batch(gen, 200, [2, 3, 2], torch.float32, device, rules=[2, 1, 2])
    want = verify(batch, path=impl).rows()
    spaced = torch.full((10, 200), float("nan"), device=device)
    spaced[7:9] = batch.q[0:2]
    spaced[1:3] = batch.q[2:4]
    inputs = _inputs(batch)
    inputs[0] = _replace(inputs[0], q_start=7)
    inputs[2] = _replace(inputs[2], q_start=1)
    assert verify(build_batch(batch.logits, inputs, spaced), path=impl).rows() == want


def test_bad_inputs_raise():
    logits = torch.zeros(3, 10)
    ok = ProposalInput(rule=1, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3)
    build_batch(logits, [ok])
    cases = [
        ([ProposalInput(rule=3, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3)], None),
        ([ProposalInput(rule=1, tokens=[1, 10], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3)], None),
        ([ProposalInput(rule=1, tokens=[1, 2], accept_uniforms=[0.1], extra_uniforms=0.3)], None),
        ([ProposalInput(rule=2, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3)], None),
        ([ProposalInput(rule=1, tokens=[], accept_uniforms=[], extra_uniforms=0.3)], None),
        ([ProposalInput(rule=1, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3,
                        sampling={"top_p_milli": 2000})], None),
        ([ProposalInput(rule=1, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3,
                        sampling={"typical_p": 5})], None),
        ([ok, ok], None),  # 3 logits rows cannot hold 2 proposals of M = 2
    ]
    for proposals, q in cases:
        with pytest.raises(VerifyInputError):
            build_batch(logits, proposals, q)
    with pytest.raises(VerifyInputError):
        build_batch(torch.zeros(3, 10, dtype=torch.int32), [ok])


def _inputs(batch) -> list[ProposalInput]:
    out = []
    for b in range(batch.num_proposals):
        m, t0 = int(batch.num_draft[b]), int(batch.token_start[b])
        out.append(ProposalInput(
            rule=int(batch.rule[b]), tokens=batch.draft_tokens[t0: t0 + m].tolist(),
            accept_uniforms=batch.accept_uniforms[t0: t0 + m].tolist(),
            extra_uniforms=batch.extra_uniforms[int(batch.row_start[b]): int(batch.row_start[b]) + m + 1].tolist(),
            sampling={"temperature_milli": int(batch.temperature_milli[b]),
                      "top_k": int(batch.top_k[b]), "top_p_milli": int(batch.top_p_milli[b])},
            q_start=int(batch.q_start[b]) if int(batch.rule[b]) == 2 else None))
    return out


def _replace(p: ProposalInput, **kw) -> ProposalInput:
    from dataclasses import replace
    return replace(p, **kw)
