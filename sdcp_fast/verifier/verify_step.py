"""From the core's jobs and the batch's logits to (accepted, extra token) per job.

Two steps, so that the device keeps the big tensors and the host waits only for small
results: `launch` makes one `kernels.verify` launch for the proposals over the logits and q
rows where they lie (on a GPU: device memory, no host copy) and returns at once; `collect`
brings back what the launch decided (B accepted counts, B tokens, B flags each) and draws
the self-decoded tokens (M = 0) from p with the same transform and the same inverse-CDF
rule (`kernels.sample`), on their single row (the batch's M = 0 rows checked, and argmaxed
under rule 1, together). `verify_jobs` does both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import kernels
from ..core.messages import RULE_GREEDY, transform_of
from ..core.problems import Kind, Problem
from ..core.session import Job


@dataclass(frozen=True)
class JobOutcome:
    accepted: int = 0
    extra: int = -1
    problem: Problem | None = None


@dataclass(frozen=True)
class Launched:
    """A verify launch in flight: its result tensors still on the device."""

    jobs: Sequence[Job]
    logits: torch.Tensor
    rows: list[int]                       # job n's first logits row
    refused: dict[int, Problem]           # jobs refused before the launch (their q rows)
    picked: list[int]                     # jobs in the launch, in order
    result: kernels.VerifyResult | kernels.PackedResult | None
    path: str | None


def launch(jobs: Sequence[Job], logits: torch.Tensor, q: torch.Tensor | None,
           q_starts: dict[int, int], q_problems: dict[int, Problem], *,
           path: str | None = None) -> Launched:
    """`logits` holds M_b + 1 rows per job in order; `q_starts[n]` is job n's first q row."""
    row_of, row = [], 0
    for job in jobs:
        row_of.append(row)
        row += job.m + 1
    if row != logits.shape[0]:
        raise ValueError(f"backend returned {logits.shape[0]} rows for {row} positions")
    picked = [n for n, job in enumerate(jobs) if n not in q_problems and job.m > 0]
    proposals = []
    for n in picked:
        job = jobs[n]
        greedy = job.rule == RULE_GREEDY
        proposals.append(kernels.ProposalInput(
            rule=job.rule,
            tokens=job.tokens,
            accept_uniforms=[0.0] * job.m if greedy else job.accept_uniforms,
            extra_uniforms=0.0 if greedy else job.draw_uniforms,   # the op picks i = a + 1
            sampling=transform_of(job.sampling),
            q_start=None if greedy else q_starts[n],
        ))
    result = None
    if proposals:
        if len(picked) == len(jobs):
            rows = logits   # every row belongs to a proposal: no copy
        else:
            rows = torch.cat([logits[row_of[n]:row_of[n] + jobs[n].m + 1] for n in picked])
        result = kernels.verify(kernels.pack_batch(rows, proposals, q=q), path=path)
    return Launched(jobs, logits, row_of, dict(q_problems), picked, result, path)


def collect(launched: Launched) -> list[JobOutcome]:
    """The outcome of every job: the launch's small results, brought to the host."""
    jobs = launched.jobs
    outcomes: list[JobOutcome | None] = [None] * len(jobs)
    for n, prob in launched.refused.items():
        outcomes[n] = JobOutcome(problem=prob)
    if launched.result is not None:
        for n, (accepted, extra, bad_q, nan_logits) in zip(launched.picked, launched.result.rows(),
                                                           strict=True):
            if bad_q:
                outcomes[n] = JobOutcome(problem=Problem(
                    Kind.BAD_PROPOSAL, "some q[i](x[i]) is zero, negative or not finite"))
            elif nan_logits:
                outcomes[n] = JobOutcome(problem=Problem(Kind.UNAVAILABLE, "target logits hold NaN"))
            else:
                outcomes[n] = JobOutcome(accepted, extra)
    own = [n for n in range(len(jobs)) if outcomes[n] is None]   # M = 0: self-decoded tokens
    if own:
        at = [launched.rows[n] for n in own]
        if at == list(range(at[0], at[0] + len(at))):   # one run of rows (every job M = 0): a view
            rows = launched.logits[at[0]:at[0] + len(at)]
        else:
            rows = launched.logits[torch.tensor(at, device=launched.logits.device)]
        for n, outcome in zip(own, self_decode([jobs[n] for n in own], rows, path=launched.path), strict=True):
            outcomes[n] = outcome
    return outcomes  # type: ignore[return-value]


def verify_jobs(jobs: Sequence[Job], logits: torch.Tensor, q: torch.Tensor | None,
                q_starts: dict[int, int], q_problems: dict[int, Problem], *,
                path: str | None = None) -> list[JobOutcome]:
    return collect(launch(jobs, logits, q, q_starts, q_problems, path=path))


def self_decode(jobs: Sequence[Job], rows: torch.Tensor, *, path: str | None = None) -> list[JobOutcome]:
    """One token from p per job (`rows`: [len(jobs), V], job n's row n): argmax of the logits
    under rule 1 (ties to the smallest id, as the kernels decide rule 1), the inverse-CDF draw
    with the job's uniform (round, i = 1, purpose 1) under rule 2. A row the kernels would
    flag (NaN, +inf, nothing finite) commits nothing. The checks and rule 1's argmax run once
    over all the rows (one host sync each, not one per job), one reduction when every job is
    rule 1 (`kernels.greedy_checked`); rule 2's rows go through one `target_probs` (each row
    under its own transform) and one `sample`: a launch per batch, not a few small ones per
    job, each of which would wake the compute thread's OpenMP team. The Triton path takes the
    rows as they are (bf16, fp16 or fp32); the others in float64."""
    if all(job.rule == RULE_GREEDY for job in jobs):   # one reduction over each row
        argmax, flags = kernels.greedy_checked(rows, path=path)
        bad = flags.tolist()
        tokens = {n: t for n, t in enumerate(argmax.tolist()) if not bad[n]}
    else:
        bad = kernels.bad_rows(rows).tolist()
        greedy_at = [n for n, job in enumerate(jobs) if job.rule == RULE_GREEDY and not bad[n]]
        argmax = kernels.greedy(rows[greedy_at]).tolist() if greedy_at else []
        tokens = dict(zip(greedy_at, argmax, strict=True))
    chosen = kernels.choose_path(rows.device, path)
    drawn = [n for n in range(len(jobs)) if not bad[n] and n not in tokens]
    if drawn:   # rule 2: one target_probs and one draw over all its rows, each its own profile
        profiles = [kernels.sampling_profile(transform_of(jobs[n].sampling)) for n in drawn]
        temperature, top_k, top_p = (torch.tensor(column, dtype=torch.int64, device=rows.device)
                                     for column in zip(*profiles, strict=True))
        picked = rows[drawn] if chosen == "triton" else rows[drawn].double()
        probs = kernels.target_probs(picked, temperature_milli=temperature, top_k=top_k,
                                     top_p_milli=top_p, path=chosen)
        uniforms = torch.tensor([jobs[n].draw_uniforms[0] for n in drawn], dtype=torch.float64,
                                device=rows.device)
        tokens.update(zip(drawn, kernels.sample(probs, uniforms, path=chosen).tolist(), strict=True))
    return [JobOutcome(problem=Problem(Kind.UNAVAILABLE, "target logits hold NaN or inf")) if bad[n]
            else JobOutcome(0, tokens[n]) for n in range(len(jobs))]
