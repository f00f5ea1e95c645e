"""One token per row for rows without a proposal: the drafter's draft tokens and the
verifier's self-decoded tokens. The same inverse-CDF rule as the verify op's extra token
(../shared/spec/NOTES.md: the smallest t with cumsum(w)[t] > u * sum(w), ascending ids),
so a token drawn here and one drawn inside `verify` agree for the same row and uniform.

Each op has the float64 reference (`reference.py`, one row at a time) beside its vectorised
torch path; `path="reference"` (or SDCP_KERNELS_PATH=reference) picks the reference.
Uniforms come from the caller: the core's HMAC derivation (verifier) or the drafter's own
generator, as tensors.
"""

from __future__ import annotations

import torch

from . import reference
from .batch import VerifyInputError
from .dispatch import choose_path


def sample(probs: torch.Tensor, uniforms: torch.Tensor | float, *, path: str | None = None) -> torch.Tensor:
    """Inverse-CDF draw of one token per row.

    Parameters
    ----------
    probs : torch.Tensor
        ``[rows, V]`` or ``[V]``, float32 or float64, non-negative weights per row with a
        positive sum (they need not be normalised). The cumulative sum is taken in float64
        over the values exactly as given.
    uniforms : torch.Tensor | float
        ``[rows]`` float64 in ``[0, 1)`` (a float or 0-d tensor for a ``[V]`` row).
    path : str | None
        ``"reference"`` for the float64 reference; anything else takes the vectorised path.

    Returns
    -------
    torch.Tensor
        ``[rows]`` int64 token ids (0-d for a ``[V]`` row): for each row the smallest t with
        ``cumsum(probs)[t] > u * sum(probs)``, never an id of zero weight.
    """
    squeeze = probs.dim() == 1
    p = probs[None] if squeeze else probs
    if p.dim() != 2 or p.dtype not in (torch.float32, torch.float64):
        raise VerifyInputError(f"probs must be [rows, V] or [V] fp32/fp64, got {p.dtype} {tuple(probs.shape)}")
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=p.device).reshape(-1)
    if u.shape != (p.shape[0],):
        raise VerifyInputError(f"uniforms must have one value per row ({p.shape[0]}), got {tuple(u.shape)}")
    if choose_path(p.device, path) == "reference":
        tokens = torch.tensor([reference.draw(p[r].to(torch.float64), float(u[r])) for r in range(p.shape[0])],
                              dtype=torch.int64, device=p.device)
    else:
        cdf = torch.cumsum(p.to(torch.float64), dim=1)                               # [rows, V]
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)  # [rows, 1]
        tokens = tokens.squeeze(1).clamp_(max=p.shape[1] - 1)   # u * sum < sum: never past V - 1
    return tokens[0] if squeeze else tokens


def greedy(logits: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """Rule 1's token: the argmax of each row, ties to the smallest id.

    Parameters
    ----------
    logits : torch.Tensor
        ``[rows, V]`` or ``[V]``, fp32, bf16, fp16 or fp64, finite rows (see `bad_rows`).

    Returns
    -------
    torch.Tensor
        ``[rows]`` int64 (0-d for a ``[V]`` row).
    """
    squeeze = logits.dim() == 1
    lg = logits[None] if squeeze else logits
    if choose_path(lg.device, path) == "reference":
        tokens = torch.tensor([reference.argmax_smallest_id(row) for row in lg], dtype=torch.int64,
                              device=lg.device)
    else:
        tokens = torch.argmax(lg, dim=1)   # torch returns the first maximal index
    return tokens[0] if squeeze else tokens


def greedy_checked(logits: torch.Tensor, *, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy` and `bad_rows` of ``[rows, V]`` logits in one reduction over each row: a row's
    maximum is NaN when it holds a NaN (torch's max propagates it), +inf when it holds +inf and
    no NaN, -inf when it holds no finite value, so the row is bad exactly when its maximum is not
    finite; the maximum's index is the first one, as `greedy`'s. The token of a bad row is
    meaningless. Returns (tokens [rows] int64, bad [rows] bool)."""
    if logits.dim() != 2:
        raise VerifyInputError(f"logits must be [rows, V], got {tuple(logits.shape)}")
    if choose_path(logits.device, path) == "reference":
        bad = bad_rows(logits)
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        if not bool(bad.all()):
            tokens[~bad] = greedy(logits[~bad], path=path)
        return tokens, bad
    values, tokens = logits.max(dim=1)
    return tokens, ~torch.isfinite(values)


def bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows the verify op would flag `nan_logits`: a NaN or +inf, or no finite value.

    Parameters
    ----------
    logits : torch.Tensor
        ``[rows, V]`` or ``[V]``, any float dtype.

    Returns
    -------
    torch.Tensor
        ``[rows]`` bool (0-d for a ``[V]`` row).
    """
    lg = logits[None] if logits.dim() == 1 else logits
    flags = torch.isnan(lg).any(dim=1) | torch.isposinf(lg).any(dim=1) | ~torch.isfinite(lg).any(dim=1)
    return flags[0] if logits.dim() == 1 else flags
