"""A kernel that the Triton interpreter runs and the compiler refuses, planted to show that
the compile check (bench/gpu_compile.py) catches what the interpreter tests cannot.

The construct: a loop-carried value whose type the loop changes (`total` starts as an
integer and the loop adds floats to it). The interpreter evaluates each statement with numpy
and lets the value change type; the compiler builds the loop in SSA form, where a carried
value keeps one type, and refuses it. It is the class of error that `_chunk_stats_kernel`'s
explicitly typed accumulators avoid.

As for every kernel: a plain torch reference (`row_sums_reference`) and a launcher that
checks shapes (`row_sums`); `launch_on_meta` is the launch the compile check records.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _planted_row_sum_kernel(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    total = 0  # planted: an integer, which the loop re-assigns to a float
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(x_ptr + row * V + offs, mask=offs < V, other=0.0), axis=0)
    tl.store(out_ptr + row, total)


def row_sums_reference(x: torch.Tensor) -> torch.Tensor:
    """The sum of each row of a ``[rows, V]`` fp32 tensor, ``[rows]`` fp32."""
    return x.sum(dim=1)


def row_sums(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """`row_sums_reference` by the planted kernel; x ``[rows, V]`` fp32."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be [rows, V] fp32, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _planted_row_sum_kernel[(x.shape[0],)](x_ptr=x, out_ptr=out, V=x.shape[1], BLOCK=block)
    return out


def launch_on_meta() -> None:
    """The launch the compile check records (meta tensors: no memory, no device)."""
    row_sums(torch.empty(4, 1000, device="meta"))
