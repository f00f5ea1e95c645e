"""The definition of correct: plain float64 torch, one row at a time, written for clarity.

Semantics (../shared/spec/NOTES.md):
- p: temperature, then top-k, then top-p, then renormalise. temperature_milli == 0 is greedy
  (one-hot on the argmax, ties to the smallest id). Top-k keeps the k largest logits, ties at
  the boundary keep the smaller ids. Top-p orders the top-k survivors by probability
  (descending, ties by smaller id; probabilities renormalised over the survivors) and keeps
  the shortest prefix whose cumulative probability reaches top_p; 0 keeps one token.
  Token order is decided on the logits themselves (temperature is monotone), so it is exact.
- Rule 1: x[i] accepted iff x[i] == argmax p[i]; argmax p equals argmax of the logits with
  ties to the smallest id for every profile (temperature, top-k and top-p never drop it).
- Rule 2: accept iff r < min(1, p(x) / q(x)); extra token from the residual
  max(0, p - q) at the first rejection (from p if its mass is 0), from p[M+1] otherwise.
  Residual entries whose q is not finite count as 0.
- Draw with u: the smallest t with cumsum(w)[t] > u * sum(w) (ascending ids).
- Flags: nan_logits when any of the proposal's M + 1 rows has a NaN or +inf or no finite
  value; bad_q when a rule-2 q[i](x[i]) is zero, negative or not finite. Either flag means
  nothing is drawn: accepted = 0, extra_token = -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import VerifyBatch, VerifyResult


def logits_row_is_bad(row: torch.Tensor) -> bool:
    return bool(torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any())


def argmax_smallest_id(row: torch.Tensor) -> int:
    best = row.max()
    return int((row == best).nonzero()[0, 0])


def descending_order(row: torch.Tensor) -> torch.Tensor:
    """Token ids by logit descending, ties by smaller id (a stable sort keeps id order)."""
    return torch.sort(row, descending=True, stable=True).indices


def target_row(logits_row: torch.Tensor, temperature_milli: int, top_k: int,
               top_p_milli: int) -> torch.Tensor:
    """p for one logits row, float64 [V]."""
    row = logits_row.to(torch.float64)
    v = row.shape[0]
    p = torch.zeros(v, dtype=torch.float64)
    if temperature_milli == 0:
        p[argmax_smallest_id(row)] = 1.0
        return p
    scaled = row / (temperature_milli / 1000.0)
    order = descending_order(row)
    kept = order if top_k == 0 else order[: min(top_k, v)]
    probs = torch.softmax(scaled[kept], dim=0)  # renormalised over the top-k survivors
    if top_p_milli < 1000:
        cumulative = torch.cumsum(probs, dim=0)
        reaching = (cumulative >= top_p_milli / 1000.0).nonzero()
        n = int(reaching[0, 0]) + 1 if reaching.numel() else kept.shape[0]
        kept = kept[:n]
        probs = torch.softmax(scaled[kept], dim=0)
    p[kept] = probs
    return p


def residual(p: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    q64 = q_row.to(torch.float64)
    return torch.where(torch.isfinite(q64) & (p > q64), p - q64, torch.zeros_like(p))


def draw(weights: torch.Tensor, u: float) -> int:
    cumulative = torch.cumsum(weights, dim=0)
    return int((cumulative > u * cumulative[-1]).nonzero()[0, 0])


@dataclass(frozen=True)
class ProposalTrace:
    """What the reference decided for one proposal, for boundary-tolerance checks."""

    accepted: int
    extra_token: int
    bad_q: bool
    nan_logits: bool
    ratios: list[float]  # min(1, p(x)/q(x)) at positions 1..min(a+1, M) (rule 2)
    draw_cdf: torch.Tensor | None  # [V] float64 normalised CDF of the extra draw (rule 2)


def trace_batch(batch: VerifyBatch) -> list[ProposalTrace]:
    logits = batch.logits.cpu()
    q = batch.q.cpu() if batch.q is not None else None
    tokens = batch.draft_tokens.tolist()
    acc_u = batch.accept_uniforms.tolist()
    out = []
    for b in range(batch.num_proposals):
        m = int(batch.num_draft[b])
        r0, t0 = int(batch.row_start[b]), int(batch.token_start[b])
        rule = int(batch.rule[b])
        prof = (int(batch.temperature_milli[b]), int(batch.top_k[b]), int(batch.top_p_milli[b]))
        rows = logits[r0: r0 + m + 1]
        xs = tokens[t0: t0 + m]
        nan = any(logits_row_is_bad(rows[i]) for i in range(m + 1))
        bad_q = False
        if rule == 2:
            qs = int(batch.q_start[b])
            qx = [float(q[qs + i, xs[i]]) for i in range(m)]
            bad_q = any(not (v > 0.0 and v < float("inf")) for v in qx)
        if nan or bad_q:
            out.append(ProposalTrace(0, -1, bad_q, nan, [], None))
            continue
        if rule == 1:
            a = 0
            while a < m and xs[a] == argmax_smallest_id(rows[a].double()):
                a += 1
            out.append(ProposalTrace(a, argmax_smallest_id(rows[a].double()), False, False, [], None))
            continue
        ratios = []
        a = 0
        p = None
        while a < m:
            p = target_row(rows[a], *prof)
            ratio = min(1.0, float(p[xs[a]]) / qx[a])
            ratios.append(ratio)
            if not acc_u[t0 + a] < ratio:
                break
            a += 1
        if a < m:
            weights = residual(p, q[qs + a])
            if float(weights.sum()) == 0.0:
                weights = p
        else:
            weights = target_row(rows[m], *prof)
        u = float(batch.extra_uniforms[r0 + a])
        cumulative = torch.cumsum(weights, dim=0)
        out.append(ProposalTrace(a, draw(weights, u), False, False, ratios,
                                 cumulative / cumulative[-1]))
    return out


def verify(batch: VerifyBatch) -> VerifyResult:
    """The verify op one proposal at a time in float64 (see `trace_batch`).

    `batch` is validated; its tensors (shape and dtype of each) are listed in
    `dispatch.verify`. Returns a VerifyResult of [B] tensors: accepted and extra_token
    int64, bad_q and nan_logits bool.
    """
    traces = trace_batch(batch)
    dev = batch.logits.device
    return VerifyResult(
        accepted=torch.tensor([t.accepted for t in traces], dtype=torch.int64, device=dev),
        extra_token=torch.tensor([t.extra_token for t in traces], dtype=torch.int64, device=dev),
        bad_q=torch.tensor([t.bad_q for t in traces], dtype=torch.bool, device=dev),
        nan_logits=torch.tensor([t.nan_logits for t in traces], dtype=torch.bool, device=dev))


def target_probs(logits: torch.Tensor, temperature_milli, top_k, top_p_milli) -> torch.Tensor:
    """p row by row in float64 (the semantics every other path is checked against).

    logits [rows, V] any float dtype; the profile tensors [rows] int64 each, checked by
    `dispatch.target_probs`. Returns p [rows, V] float64 on the logits' device.
    """
    rows = [target_row(logits[r].cpu(), int(temperature_milli[r]), int(top_k[r]),
                       int(top_p_milli[r])) for r in range(logits.shape[0])]
    return torch.stack(rows).to(logits.device)
