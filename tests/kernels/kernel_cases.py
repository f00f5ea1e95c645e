"""Random verify batches and the reference-agreement check shared by the kernel tests."""

from __future__ import annotations

import os

import pytest
import torch
from sdcp_fast.kernels import ProposalInput, VerifyBatch, VerifyResult, build_batch, native
from sdcp_fast.kernels.reference import trace_batch


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_native() -> None:
    """Skip when the native op is not built, or fail when SDCP_REQUIRE_NATIVE=1 (`make test`
    sets it: there a missing build is a broken build, not a machine without a compiler)."""
    if not native.available():
        why = f"native op unavailable: {native.unavailable_reason()}"
        if os.environ.get("SDCP_REQUIRE_NATIVE") == "1":
            pytest.fail(why)
        pytest.skip(why)


BOUNDARY_TOL = 1e-6  # a draw may differ from the reference only this close to a CDF boundary

TEMPERATURES = (0, 500, 1000, 2000)
TOP_PS = (0, 500, 900, 1000)


def top_ks(vocab: int) -> tuple[int, ...]:
    return (0, 1, 37, vocab)


def random_logits(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype,
                  ties: bool = False) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2.5
    if ties:  # few distinct values: many exact ties, also at top-k/top-p boundaries
        x = torch.round(x * 2) / 2
    return x.to(dtype)


def random_q(gen: torch.Generator, rows: int, vocab: int, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Draft rows: a perturbed copy of the target when given (realistic acceptance), else random."""
    noise = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    base = logits.double() if logits is not None else noise
    return torch.softmax(base + 0.7 * noise, dim=-1).float()


def random_profile(gen: torch.Generator, vocab: int) -> dict[str, int]:
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=gen))]  # noqa: E731
    prof = {"temperature_milli": pick(TEMPERATURES), "top_k": pick(top_ks(vocab)),
            "top_p_milli": pick(TOP_PS)}
    # sometimes leave keys out: the defaults of ../shared/spec/NOTES.md apply
    return {k: v for k, v in prof.items() if int(torch.randint(4, (1,), generator=gen)) != 0}


def mixed_batch(gen: torch.Generator, vocab: int, ms: list[int], dtype: torch.dtype,
                device: torch.device, ties: bool = False, rules: list[int] | None = None,
                profiles: list[dict] | None = None) -> VerifyBatch:
    """A ragged batch of len(ms) proposals, rules and profiles mixed, draft tokens drawn from q
    (rule 2) or mostly the argmax (rule 1) so that acceptance chains are long."""
    b = len(ms)
    rules = rules or [1 + int(torch.randint(2, (1,), generator=gen)) for _ in range(b)]
    profiles = profiles or [random_profile(gen, vocab) for _ in range(b)]
    logits = random_logits(gen, sum(m + 1 for m in ms), vocab, dtype, ties)
    q_rows = []
    props = []
    row = 0
    for m, rule, prof in zip(ms, rules, profiles, strict=True):
        rows = logits[row: row + m]
        if rule == 2:
            q = random_q(gen, m, vocab, rows)
            q_rows.append(q)
            tokens = torch.multinomial(q.double(), 1, generator=gen)[:, 0].tolist()
        else:
            argmax = rows.double().argmax(dim=-1)
            noise = torch.randint(vocab, (m,), generator=gen)
            keep = torch.rand(m, generator=gen) < 0.85
            tokens = torch.where(keep, argmax, noise).tolist()
        props.append(ProposalInput(
            rule=rule, tokens=tokens,
            accept_uniforms=torch.rand(m, generator=gen, dtype=torch.float64).tolist(),
            extra_uniforms=torch.rand(m + 1, generator=gen, dtype=torch.float64).tolist(),
            sampling=prof))
        row += m + 1
    q = torch.cat(q_rows).to(device) if q_rows else None
    return build_batch(logits.to(device), props, q)


def assert_matches_reference(batch: VerifyBatch, got: VerifyResult) -> int:
    """Field-by-field equality with the reference, except draws whose uniform lies within
    BOUNDARY_TOL of the reference's decision boundary. Returns the number of such draws."""
    traces = trace_batch(batch)
    rows = got.rows()
    acc_u = batch.accept_uniforms.cpu().tolist()
    extra_u = batch.extra_uniforms.cpu().tolist()
    boundary = 0
    for b, (ref, (a, extra, bad_q, nan)) in enumerate(zip(traces, rows, strict=True)):
        assert (bad_q, nan) == (ref.bad_q, ref.nan_logits), f"proposal {b}: flags"
        exact = ref.bad_q or ref.nan_logits or int(batch.rule[b]) == 1 or int(batch.temperature_milli[b]) == 0
        if exact or (a, extra) == (ref.accepted, ref.extra_token):
            assert (a, extra) == (ref.accepted, ref.extra_token), f"proposal {b}: {(a, extra)} vs {ref}"
            continue
        if a != ref.accepted:
            j = min(a, ref.accepted)
            u = acc_u[int(batch.token_start[b]) + j]
            assert abs(u - ref.ratios[j]) <= BOUNDARY_TOL, f"proposal {b}: acceptance at {j + 1}"
        else:
            t = min(extra, ref.extra_token)
            u = extra_u[int(batch.row_start[b]) + a]
            assert abs(float(ref.draw_cdf[t]) - u) <= BOUNDARY_TOL, f"proposal {b}: draw"
        boundary += 1
    return boundary
