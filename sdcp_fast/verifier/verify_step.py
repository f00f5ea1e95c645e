"""From the core's jobs and the batch's logits to (accepted, extra token) per job.

Proposals go through one `kernels.verify` launch; self-decoded tokens (M = 0) are drawn
from p with the same transform and the same inverse-CDF rule (`kernels.sample`), on their
single row.
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


def verify_jobs(jobs: Sequence[Job], logits: torch.Tensor, q: torch.Tensor | None,
                q_starts: dict[int, int], q_problems: dict[int, Problem]) -> list[JobOutcome]:
    """`logits` holds M_b + 1 rows per job in order; `q_starts[n]` is job n's first q row."""
    outcomes: list[JobOutcome | None] = [None] * len(jobs)
    row_of, row = [], 0
    for job in jobs:
        row_of.append(row)
        row += job.m + 1
    if row != logits.shape[0]:
        raise ValueError(f"backend returned {logits.shape[0]} rows for {row} positions")

    proposals, picked = [], []
    for n, job in enumerate(jobs):
        if n in q_problems:
            outcomes[n] = JobOutcome(problem=q_problems[n])
        elif job.m == 0:
            outcomes[n] = self_decode(job, logits[row_of[n]])
        else:
            picked.append(n)
            greedy = job.rule == RULE_GREEDY
            proposals.append(kernels.ProposalInput(
                rule=job.rule,
                tokens=job.tokens,
                accept_uniforms=[0.0] * job.m if greedy else job.accept_uniforms,
                extra_uniforms=0.0 if greedy else job.draw_uniforms,   # the op picks i = a + 1
                sampling=transform_of(job.sampling),
                q_start=None if greedy else q_starts[n],
            ))
    if proposals:
        rows = torch.cat([logits[row_of[n]:row_of[n] + jobs[n].m + 1] for n in picked])
        result = kernels.verify(kernels.build_batch(rows, proposals, q=q))
        for n, (accepted, extra, bad_q, nan_logits) in zip(picked, result.rows(), strict=True):
            if bad_q:
                outcomes[n] = JobOutcome(problem=Problem(
                    Kind.BAD_PROPOSAL, "some q[i](x[i]) is zero, negative or not finite"))
            elif nan_logits:
                outcomes[n] = JobOutcome(problem=Problem(Kind.UNAVAILABLE, "target logits hold NaN"))
            else:
                outcomes[n] = JobOutcome(accepted, extra)
    return outcomes  # type: ignore[return-value]


def self_decode(job: Job, row: torch.Tensor) -> JobOutcome:
    """One token from p: argmax of the logits under rule 1 (ties to the smallest id, as the
    kernels decide rule 1), the inverse-CDF draw with the job's uniform (round, i = 1,
    purpose 1) under rule 2. A row the kernels would flag (NaN, +inf, nothing finite)
    commits nothing."""
    if bool(kernels.bad_rows(row)):
        return JobOutcome(problem=Problem(Kind.UNAVAILABLE, "target logits hold NaN or inf"))
    if job.rule == RULE_GREEDY:
        return JobOutcome(0, int(kernels.greedy(row)))
    p = kernels.target_probs(row.unsqueeze(0).double(), **transform_of(job.sampling))[0]
    return JobOutcome(0, int(kernels.sample(p, job.draw_uniforms[0])))
