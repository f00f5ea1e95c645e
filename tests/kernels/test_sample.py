"""kernels.sample / greedy / bad_rows: the vectorised path token-exact with the float64
reference, on rows with zero-weight ids, ties and extreme uniforms."""

from __future__ import annotations

import pytest
import torch
from sdcp_fast.kernels import reference

from sdcp_fast import kernels


def rows(n: int, v: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, v, generator=g, dtype=torch.float64)
    w[w < 0.5] = 0.0                       # half the ids carry no weight
    w[:, 0] = 0.0                          # nor does the first: a draw at u = 0 must skip it
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_matches_the_reference_draw(dtype):
    p = rows(64, 257, 1, dtype)
    g = torch.Generator().manual_seed(2)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 0.5, 1.0 - 2.0 ** -53], dtype=torch.float64)
    fast = kernels.sample(p, u)
    slow = kernels.sample(p, u, path="reference")
    expected = [reference.draw(p[r].double(), float(u[r])) for r in range(64)]
    assert fast.dtype == torch.int64 and fast.tolist() == slow.tolist() == expected
    assert bool((p[torch.arange(64), fast] > 0).all())     # never an id of zero weight


def test_sample_one_row_and_a_float_uniform():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75], dtype=torch.float32)
    assert int(kernels.sample(p, 0.0)) == 1
    assert int(kernels.sample(p, 0.2499)) == 1
    assert int(kernels.sample(p, 0.25)) == 3          # cdf > u * sum: the boundary goes up
    assert kernels.sample(p, 0.9).dim() == 0


def test_sample_refuses_mismatched_uniforms():
    with pytest.raises(kernels.VerifyInputError):
        kernels.sample(torch.ones(3, 5), torch.zeros(2, dtype=torch.float64))


def test_greedy_ties_to_the_smallest_id_like_the_reference():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0], [-5.0, -5.0, -4.0, -4.0]])
    assert kernels.greedy(logits).tolist() == [1, 0, 2]
    assert kernels.greedy(logits, path="reference").tolist() == [1, 0, 2]
    assert int(kernels.greedy(logits[0])) == 1


def test_bad_rows_flags_what_verify_flags():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, 1.0], [nan, 1.0], [inf, 1.0], [-inf, -inf], [-inf, 2.0]])
    assert kernels.bad_rows(logits).tolist() == [False, True, True, True, False]
    assert [reference.logits_row_is_bad(r) for r in logits] == kernels.bad_rows(logits).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_checked_is_greedy_and_bad_rows_at_once(dtype):
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[0.0, 1.0, 1.0], [nan, 1.0, 2.0], [1.0, inf, 1.0], [-inf, -inf, -inf],
                            [-inf, 2.0, 2.0], [inf, nan, 3.0], [3.0, -inf, nan]])
    random = torch.randn(40, 301, generator=torch.Generator().manual_seed(3))
    random[::7, 5] = random[::7].max(dim=1).values   # ties: the smallest id wins
    for logits in (special.to(dtype), random.to(dtype)):
        for path in (None, "reference"):
            tokens, bad = kernels.greedy_checked(logits, path=path)
            assert bad.tolist() == kernels.bad_rows(logits).tolist()
            good = [n for n, b in enumerate(bad.tolist()) if not b]
            assert tokens[good].tolist() == kernels.greedy(logits[good], path="reference").tolist()
