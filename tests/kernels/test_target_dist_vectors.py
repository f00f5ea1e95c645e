"""target_dist[] of the shared known-answer vectors, for every implementation."""

import json
from pathlib import Path

import pytest
import torch
from kernel_cases import interpreting, require_native
from sdcp_fast.kernels import target_probs

VECTORS = Path("/work/shared/vectors/sdcp-vectors.json")
TOL = 2e-5


def load_cases() -> list[dict]:
    # a missing or empty file must fail the run, never skip it
    cases = json.loads(VECTORS.read_text())["target_dist"]
    assert cases, "no target_dist vectors"
    return cases


CASES = load_cases()


@pytest.mark.parametrize("impl", ["reference", "cpu", "native", "triton"])
def test_vectors_all_rows_in_one_call(impl, device):
    if impl == "triton":
        if (device.type == "cpu") != interpreting():
            pytest.skip("Triton runs on CUDA tensors, or on CPU tensors in the interpreter")
    if impl == "native":
        if device.type != "cpu":
            pytest.skip("the native op runs on CPU tensors")
        require_native()
    for case in CASES:
        s = case["sampling"]
        logits = torch.tensor(case["logits"], dtype=torch.float32, device=device)
        got = target_probs(logits, s.get("temperature_milli"), s.get("top_k"),
                           s.get("top_p_milli"), path=impl)
        want = torch.tensor(case["p"], dtype=torch.float64)
        assert got.shape == want.shape
        assert torch.allclose(got.double().cpu(), want, atol=TOL, rtol=0), (s, got, want)
        # the support (which tokens are kept) must be exact, not just close
        assert torch.equal(got.cpu() > 0, want > 0), s


@pytest.mark.parametrize("impl", ["cpu", "native"])
def test_vectors_batched_profiles_per_row(impl):
    """All vectors of one width as one batch with [rows] profile tensors (CPU paths)."""
    if impl == "native":
        require_native()
    by_width: dict[int, list[dict]] = {}
    for case in CASES:
        by_width.setdefault(len(case["logits"]), []).append(case)
    for cases in by_width.values():
        logits = torch.tensor([c["logits"] for c in cases], dtype=torch.float32)
        prof = [(c["sampling"].get("temperature_milli", 1000), c["sampling"].get("top_k", 0),
                 c["sampling"].get("top_p_milli", 1000)) for c in cases]
        t, k, p = (torch.tensor(col) for col in zip(*prof, strict=True))
        got = target_probs(logits, t, k, p, path=impl).double()
        want = torch.tensor([c["p"] for c in cases], dtype=torch.float64)
        assert torch.allclose(got, want, atol=TOL, rtol=0)
