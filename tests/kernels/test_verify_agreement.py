"""verify of the CPU path and the Triton kernels against the float64 reference, on shared
uniforms: token-exact except draws within 1e-6 of a CDF boundary (each one is checked)."""

import pytest
import torch
from kernel_cases import assert_matches_reference, mixed_batch, require_native
from sdcp_fast.kernels import verify

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [257, 1000])
def test_mixed_batches(target, dtype, vocab):
    device, impl = target
    gen = torch.Generator().manual_seed(vocab * 10 + DTYPES.index(dtype))
    ms = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 1, 5]  # M from 1 to 9, ragged
    batch = mixed_batch(gen, vocab, ms, dtype, device)
    got = verify(batch, path=impl)
    assert got.accepted.device.type == device.type
    boundary = assert_matches_reference(batch, got)
    assert boundary <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ties_in_low_precision_logits(target, dtype):
    """Rounded logits: many exact ties at the argmax and at top-k/top-p boundaries."""
    device, impl = target
    gen = torch.Generator().manual_seed(11)
    ms = [4, 2, 6, 1, 3, 5, 2, 4]
    batch = mixed_batch(gen, 300, ms, dtype, device, ties=True)
    assert_matches_reference(batch, verify(batch, path=impl))


@pytest.mark.parametrize("temperature", [0, 500, 1000, 2000])
def test_every_temperature_with_filters(target, temperature):
    device, impl = target
    gen = torch.Generator().manual_seed(temperature + 3)
    vocab = 513
    profiles = [{"temperature_milli": temperature, "top_k": k, "top_p_milli": p}
                for k in (0, 1, 37, vocab) for p in (0, 500, 900, 1000)]
    ms = [1 + i % 4 for i in range(len(profiles))]
    batch = mixed_batch(gen, vocab, ms, torch.float32, device, rules=[2] * len(ms), profiles=profiles)
    assert_matches_reference(batch, verify(batch, path=impl))


@pytest.mark.slow
def test_larger_vocab(target):
    """V = 4099 (not a multiple of any block), a few proposals: the interpreter's upper size."""
    device, impl = target
    gen = torch.Generator().manual_seed(4099)
    batch = mixed_batch(gen, 4099, [3, 1, 4], torch.bfloat16, device,
                        rules=[2, 1, 2],
                        profiles=[{}, {"top_k": 5}, {"temperature_milli": 700, "top_p_milli": 900}])
    assert_matches_reference(batch, verify(batch, path=impl))


@pytest.mark.parametrize("impl", ["cpu", "native", "native-scalar"])
def test_cpu_paths_many_random_batches(impl, monkeypatch):
    """Many cheap batches on the CPU paths: boundary-only disagreements over ~2k draws (none
    for the native op, which rechecks its float decisions in double)."""
    if impl.startswith("native"):
        require_native()
        if impl == "native-scalar":
            monkeypatch.setenv("SDCP_NATIVE_ISA", "scalar")
        impl = "native"
    gen = torch.Generator().manual_seed(5)
    total_boundary = 0
    for round_ in range(20):
        vocab = [97, 257, 640][round_ % 3]
        ms = torch.randint(1, 10, (16,), generator=gen).tolist()
        batch = mixed_batch(gen, vocab, ms, DTYPES[round_ % 3], torch.device("cpu"))
        total_boundary += assert_matches_reference(batch, verify(batch, path=impl))
    assert total_boundary <= (0 if impl == "native" else 2)
