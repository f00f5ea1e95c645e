"""Choose the implementation: Triton for CUDA tensors; on the CPU the native op (csrc/) when
it is built, kernels/cpu.py otherwise.

Override with the `path` argument or the SDCP_KERNELS_PATH environment variable
("reference", "cpu", "native" or "triton"; "native" runs on CPU tensors only; "triton" on CPU
tensors needs TRITON_INTERPRET=1 set before triton is imported, which is how the tests run the
kernels without a GPU).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from . import cpu, native, reference
from .batch import (
    DEFAULT_TEMPERATURE_MILLI,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P_MILLI,
    PackedBatch,
    PackedResult,
    VerifyBatch,
    VerifyInputError,
    VerifyResult,
)

PATHS = ("reference", "cpu", "native", "triton")
ENV_VAR = "SDCP_KERNELS_PATH"


@cache
def _triton_module():
    try:
        from . import triton_path
    except ImportError:  # triton not installed: the CPU path serves
        return None
    return triton_path


def available_paths() -> tuple[str, ...]:
    return tuple(p for p in PATHS if (p != "triton" or _triton_module() is not None)
                 and (p != "native" or native.available()))


def choose_path(device: torch.device, path: str | None = None) -> str:
    path = path or os.environ.get(ENV_VAR) or None
    if path is None:
        if device.type == "cuda":
            return "triton" if _triton_module() is not None else "cpu"
        return "native" if native.available() else "cpu"
    if path not in PATHS:
        raise VerifyInputError(f"unknown kernels path {path!r}; choose one of {PATHS}")
    if path == "triton" and _triton_module() is None:
        raise VerifyInputError("kernels path 'triton' requested but triton is not importable")
    if path == "native":
        if device.type != "cpu":
            raise VerifyInputError(f"kernels path 'native' runs on CPU tensors, not {device.type}")
        if not native.available():
            raise VerifyInputError(f"kernels path 'native' requested but {native.unavailable_reason()}")
    return path


def verify(batch: VerifyBatch | PackedBatch, path: str | None = None) -> VerifyResult | PackedResult:
    """Accepted count, extra token and flags for every proposal of a ragged verify batch.

    Parameters
    ----------
    batch : VerifyBatch | PackedBatch
        B proposals, N = sum(M_b) draft tokens, R = N + B logits rows, all on one device
        (layout in batch.py; `build_batch` makes one from Python values, `pack_batch` the
        same tensors packed into two, which the native op reads as they are and every other
        path unpacks):

        - ``logits`` ``[R, V]`` fp32, bf16 or fp16;
        - ``draft_tokens`` ``[N]`` int64 in ``0..V-1``;
        - ``num_draft`` (M_b >= 1), ``rule`` (1 or 2), ``temperature_milli``, ``top_k``,
          ``top_p_milli``, ``q_start`` (-1 for rule 1), ``row_start``, ``token_start``
          ``[B]`` int64;
        - ``q`` ``[Q, V]`` fp32 draft probabilities of the rule-2 rows, or None;
        - ``accept_uniforms`` ``[N]`` float64 (purpose 0) and ``extra_uniforms`` ``[R]``
          float64 (purpose 1, row layout), in ``[0, 1)``.
    path : str | None
        "reference", "cpu", "native" or "triton"; None picks by device (module docstring).

    Returns
    -------
    VerifyResult
        ``accepted`` ``[B]`` int64 (0 when flagged), ``extra_token`` ``[B]`` int64 (-1 when
        flagged), ``bad_q`` ``[B]`` bool, ``nan_logits`` ``[B]`` bool; for a PackedBatch on
        the native path a PackedResult, the same four as the rows of one ``[4, B]`` int64
        tensor. Both give ``rows()``: (accepted, extra_token, bad_q, nan_logits) per proposal.

    Raises VerifyInputError for inconsistent shapes, dtypes, devices or an unknown path.
    """
    chosen = choose_path(batch.logits.device, path)
    if isinstance(batch, PackedBatch):
        if chosen == "native":
            return native.verify_packed(batch)
        batch = batch.unpack()
    batch.validate_once()   # build_batch's batches are checked there
    if chosen == "reference":
        return reference.verify(batch)
    if chosen == "cpu":
        return cpu.verify(batch)
    if chosen == "native":
        return native.verify(batch)
    return _triton_module().verify(batch)


def _per_row(value, default: int, rows: int, device: torch.device) -> torch.Tensor:
    if value is None:
        value = default
    t = torch.as_tensor(value, dtype=torch.int64, device=device)
    if t.dim() == 0:
        return t.expand(rows).contiguous()
    if t.shape != (rows,):
        raise VerifyInputError(f"profile tensor must be a scalar or [{rows}], got {tuple(t.shape)}")
    return t


def target_probs(logits: torch.Tensor, temperature_milli=None, top_k=None, top_p_milli=None,
                 path: str | None = None) -> torch.Tensor:
    """The target distribution p of each logits row (temperature, then top-k, then top-p).

    Parameters
    ----------
    logits : torch.Tensor
        ``[rows, V]`` or ``[V]``, fp32, bf16 or fp16.
    temperature_milli, top_k, top_p_milli : int | torch.Tensor | None
        A scalar or a ``[rows]`` int64 tensor each: temperature in thousandths (0 = greedy),
        top-k (0 = off), top-p in thousandths ``0..1000`` (1000 = off). None takes the
        default of ../shared/spec/NOTES.md, "Sampling profile -> target distribution p".
    path : str | None
        "reference", "cpu", "native" or "triton"; None picks by device.

    Returns
    -------
    torch.Tensor
        ``[rows, V]`` (``[V]`` for a ``[V]`` row), fp32 (float64 from the reference), on the
        logits' device.
    """
    squeeze = logits.dim() == 1
    lg = logits[None] if squeeze else logits
    if lg.dim() != 2:
        raise VerifyInputError("logits must be [V] or [rows, V]")
    rows, dev = lg.shape[0], lg.device
    t = _per_row(temperature_milli, DEFAULT_TEMPERATURE_MILLI, rows, dev)
    k = _per_row(top_k, DEFAULT_TOP_K, rows, dev)
    p = _per_row(top_p_milli, DEFAULT_TOP_P_MILLI, rows, dev)
    if bool((t < 0).any() or (k < 0).any() or (p < 0).any() or (p > 1000).any()):
        raise VerifyInputError("bad sampling profile")
    chosen = choose_path(dev, path)
    if chosen == "reference":
        out = reference.target_probs(lg, t, k, p)
    elif chosen == "cpu":
        out = cpu.target_probs(lg, t, k, p)
    elif chosen == "native":
        out = native.target_probs(lg, t, k, p)
    else:
        out = _triton_module().target_probs(lg, t, k, p)
    return out[0] if squeeze else out
