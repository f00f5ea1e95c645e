"""target_probs of the CPU path and the Triton kernels against the float64 reference."""

import itertools

import pytest
import torch
from kernel_cases import TEMPERATURES, TOP_PS, random_logits, require_native, top_ks
from sdcp_fast.kernels import VerifyInputError, target_probs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def profile_grid(vocab: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cross product of the profile values, one per row, cycled over `rows` rows."""
    grid = list(itertools.product(TEMPERATURES, top_ks(vocab), TOP_PS))
    picked = [grid[i % len(grid)] for i in range(rows)]
    t, k, p = (torch.tensor(col, dtype=torch.int64) for col in zip(*picked, strict=True))
    return t, k, p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_every_profile_matches_reference(target, dtype, ties):
    device, impl = target
    vocab = 257  # not a multiple of any block size
    gen = torch.Generator().manual_seed(7 + int(ties))
    rows = 64  # the whole 4 x 4 x 4 profile grid, one row each
    logits = random_logits(gen, rows, vocab, dtype, ties)
    t, k, p = profile_grid(vocab, rows)
    want = target_probs(logits, t, k, p, path="reference")
    got = target_probs(logits.to(device), t.to(device), k.to(device), p.to(device), path=impl)
    got = got.cpu().double()
    # kept sets are decided exactly (ties keep smaller ids); values within fp32 rounding
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(got.sum(dim=1), torch.ones(rows, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("vocab", [1000, 4099])
def test_wide_rows_top_p_beyond_candidates(target, vocab):
    """Flat rows where top-p keeps more tokens than the CPU path's candidate window."""
    device, impl = target
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen) * 0.05  # nearly uniform: top-p keeps ~90% of V
    t = torch.tensor([1000, 2000, 500, 1000])
    k = torch.tensor([0, 0, vocab - 3, 1500])
    p = torch.tensor([900, 999, 950, 900])
    want = target_probs(logits, t, k, p, path="reference")
    got = target_probs(logits.to(device), t.to(device), k.to(device), p.to(device), path=impl).cpu()
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "cpu", "native", "triton"])
def test_ties_keep_smaller_ids_exactly(device, impl):
    from kernel_cases import interpreting, require_native
    if impl == "triton" and (device.type == "cpu") != interpreting():
        pytest.skip("Triton runs on CUDA tensors, or on CPU tensors in the interpreter")
    if impl == "native":
        if device.type != "cpu":
            pytest.skip("the native op runs on CPU tensors")
        require_native()
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]], device=device)

    def kept(t, k, p):
        probs = target_probs(logits, t, k, p, path=impl)
        return probs[0].cpu().double()

    # top-k 2 among three tied maxima (ids 1, 3, 4): ids 1 and 3 are kept, equally
    assert (kept(1000, 2, 1000) > 0).nonzero()[:, 0].tolist() == [1, 3]
    # top-p 0 keeps the single most probable token, the smallest tied id
    assert kept(1000, 0, 0).tolist() == [0, 1, 0, 0, 0, 0]
    # greedy: one-hot on the smallest tied argmax, whatever the filters
    assert kept(0, 0, 1000).tolist() == [0, 1, 0, 0, 0, 0]
    assert kept(0, 5, 300).tolist() == [0, 1, 0, 0, 0, 0]
    # top-p 0.5: the three tied maxima have ~0.29 each; the prefix 1, 3 reaches 0.5
    assert (kept(1000, 0, 500) > 0).nonzero()[:, 0].tolist() == [1, 3]
    # -0.0 and +0.0 are the same logit: the tie goes to the smaller id
    zeros = torch.tensor([[-1.0, 0.0, -0.0, -2.0]], device=device)
    assert target_probs(zeros, 1000, 1, 1000, path=impl)[0].cpu().tolist() == [0, 1, 0, 0]
    swapped = torch.tensor([[-1.0, -0.0, 0.0, -2.0]], device=device)
    assert target_probs(swapped, 1000, 1, 1000, path=impl)[0].cpu().tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("impl", ["cpu", "native"])
def test_defaults_and_bad_profiles(impl):
    if impl == "native":
        require_native()
    logits = torch.randn(3, 50)
    plain = target_probs(logits, path=impl)
    assert torch.allclose(plain, torch.softmax(logits, dim=-1), atol=1e-6)
    one = target_probs(logits[0], 500, None, None, path=impl)
    assert one.shape == (50,)
    with pytest.raises(VerifyInputError):
        target_probs(logits, top_p_milli=1001, path=impl)
    with pytest.raises(VerifyInputError):
        target_probs(logits, temperature_milli=torch.tensor([1, 2]), path=impl)
    with pytest.raises(VerifyInputError):
        target_probs(logits, path="cuda-magic")
