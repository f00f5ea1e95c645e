"""CPU-path verify throughput, side by side with this machine's memory-copy bandwidth.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest bench/bench_kernels.py --benchmark-only \
        --benchmark-min-rounds 3 -s

Grid: V in {32k, 128k}, B in {1, 8, 32}, M in {4, 8}; every proposal rule 2 with the default
profile (temperature 1, no top-k/top-p: the full softmax work), fp32 logits, q rows drawn
near p so acceptance chains are realistic. Effective GB/s counts the bytes the op must read
at least once: all logits (R = B (M + 1) rows x V x 4 B) plus one q row per proposal. The copy
line times `dst.copy_(src)` on a 256 MiB fp32 buffer in the same run and counts read + write
bytes; `ratio` = verify GB/s / copy GB/s (1.0 would be verify at the speed of one memcpy).
Also one filtered profile (top-k 50, top-p 0.9, T 0.7) at B 8, M 8 for each V.
Each point runs with torch.set_num_threads(1) and (2): on a 2-core machine shared with other
work, torch's OpenMP barriers stall whenever the second core is busy, so one thread is the
steadier production setting there.
"""

from __future__ import annotations

import time

import pytest
import torch
from sdcp_fast.kernels import ProposalInput, build_batch, verify

VOCABS = [32_768, 131_072]
BATCHES = [1, 8, 32]
DRAFTS = [4, 8]
COPY_BYTES = 256 << 20
_copy_gbps: list[float] = []


def copy_bandwidth() -> float:
    """GB/s of a large fp32 tensor copy (read + write bytes), best of 5, measured once."""
    if not _copy_gbps:
        src = torch.randn(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
        _copy_gbps.append(2 * COPY_BYTES / best / 1e9)
    return _copy_gbps[0]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_batch(vocab: int, b: int, m: int, sampling: dict | None = None):
    gen = torch.Generator().manual_seed(vocab + 31 * b + m)
    rows = b * (m + 1)
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    q = torch.empty(b * m, vocab)
    props = []
    for i in range(b):
        lg = logits[i * (m + 1): i * (m + 1) + m]
        q[i * m: (i + 1) * m] = torch.softmax(lg + 0.5 * torch.randn(lg.shape, generator=gen), -1)
        tokens = torch.multinomial(q[i * m: (i + 1) * m], 1, generator=gen)[:, 0].tolist()
        props.append(ProposalInput(
            rule=2, tokens=tokens,
            accept_uniforms=torch.rand(m, generator=gen, dtype=torch.float64).tolist(),
            extra_uniforms=torch.rand(m + 1, generator=gen, dtype=torch.float64).tolist(),
            sampling=sampling or {}))
    return build_batch(logits, props, q)


def _report(benchmark, batch, label: str) -> None:
    rows, vocab = batch.logits.shape
    b = batch.num_proposals
    needed = rows * vocab * batch.logits.element_size() + b * vocab * 4
    median = benchmark.stats.stats.median
    gbps = needed / median / 1e9
    copy = copy_bandwidth()
    benchmark.extra_info.update(gbps=round(gbps, 3), copy_gbps=round(copy, 3),
                                ratio_to_copy=round(gbps / copy, 3))
    print(f"\n[kernels-cpu] {label}: median {median * 1e3:.2f} ms, {gbps:.2f} GB/s, "
          f"copy {copy:.2f} GB/s, ratio {gbps / copy:.3f}")


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    before = torch.get_num_threads()
    copy_bandwidth()  # measured once, with the default thread count
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("m", DRAFTS)
@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_verify_cpu_default_profile(benchmark, threads, vocab, b, m):
    batch = make_batch(vocab, b, m)
    benchmark(verify, batch, "cpu")
    _report(benchmark, batch, f"V={vocab} B={b} M={m} default threads={threads}")


@pytest.mark.parametrize("vocab", VOCABS)
def test_verify_cpu_filtered_profile(benchmark, threads, vocab):
    batch = make_batch(vocab, 8, 8, {"temperature_milli": 700, "top_k": 50, "top_p_milli": 900})
    benchmark(verify, batch, "cpu")
    _report(benchmark, batch, f"V={vocab} B=8 M=8 top-k 50 top-p 0.9 threads={threads}")
