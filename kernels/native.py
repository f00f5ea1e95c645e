"""The native CPU op (csrc/, built by setup.py): loading and launchers.

`verify(batch)` and `target_probs(logits, temperature_milli, top_k, top_p_milli)` take and
return what kernels/cpu.py does; they call the torch custom ops `torch.ops.sdcp.verify` and
`torch.ops.sdcp.target_probs` (csrc/sdcp_ops.cpp, CPU implementation in
csrc/cpu/verify_cpu.cpp): one streaming pass per logits row (max, argmax, online sum of exp in
float, AVX-512, AVX2 or portable loops chosen at run time: csrc/cpu/isa.cpp), threads over rows, top-k / top-p without a
sort over V, decisions rechecked in double near their boundaries (csrc/cpu/rows.cpp).

verify_packed(batch) takes a PackedBatch (batch.py: the same tensors packed into `ints` and
`floats`) and returns a PackedResult ([4, B] int64: accepted, extra_token, bad_q, nan_logits).

verify tensors (all on the CPU; B proposals, N = sum M_b draft tokens, R logits rows):
    logits            [R, V]  fp32 | bf16 | fp16 (a non-contiguous tensor is copied)
    draft_tokens      [N]     int64, in 0..V-1
    num_draft, rule, temperature_milli, top_k, top_p_milli, q_start, row_start, token_start
                      [B]     int64
    q                 [Q, V]  fp32 or None (no rule-2 proposal)
    accept_uniforms   [N]     float64
    extra_uniforms    [R]     float64
  -> accepted [B] int64, extra_token [B] int64, bad_q [B] bool, nan_logits [B] bool
Each logits row belongs to at most one proposal; every index is checked before a row is read
(VerifyInputError otherwise).

target_probs tensors:
    logits [rows, V] fp32 | bf16 | fp16 (other float dtypes are read as fp32, as cpu.py does);
    temperature_milli, top_k, top_p_milli [rows] int64  ->  p [rows, V] fp32
    (a row with NaN, +inf or no finite logit gives a NaN row)

rows_linear tensors (a linear layer without bias, for the few rows of a verify pass or a
decode step: csrc/cpu/twin_cpu.cpp; its reference is `torch.nn.functional.linear`):
    x [n, in] fp32, weight [out, in] fp32, both contiguous, in a multiple of ROWS_LINEAR_COLUMNS
    -> y [n, out] fp32 = x @ weight.T (summed in its own order: fp32 rounding, not bit for bit)

q8_linear tensors (the twin's product over 8-bit activations: csrc/cpu/twin_cpu.cpp, loops in
twin_loops_avx512.cpp; its reference is `q8_linear_reference`, equal to it bit for bit):
    x [n, in] fp32, weight [out, in] int8, scale [out] fp32, contiguous, in a multiple of
    ROWS_LINEAR_COLUMNS -> y [n, out] fp32; only where `int8_dot_products()` (AVX512-VNNI)

paged_attention tensors (attention over K/V kept in pages, kv_pages.py's layout:
csrc/cpu/twin_cpu.cpp; its reference is `paged_attention_reference`):
    query [T, heads, head_dim] fp32; keys, values [R, kv_heads, head_dim] fp32 contiguous, R a
    whole number of pages; query_rows, query_keys, query_pages [n] int64; pages [P] int64
    -> [n, heads, head_dim] fp32: query_rows[i] attends over its session's positions
    0..query_keys[i]-1, position p at keys row pages[query_pages[i] + p // page] * page + p % page

Without the built library (no compiler when the package was installed, or an isolated build)
`available()` is False, the dispatcher uses kernels/cpu.py, and a warning says so once.
SDCP_NATIVE_ISA=scalar makes the op use its portable loops, =avx2 its AVX2 ones on an
AVX-512 machine (the tests run every one the CPU has).
"""

from __future__ import annotations

import importlib.util
import logging
from functools import cache

import torch

from .batch import (
    LOGIT_DTYPES,
    PackedBatch,
    PackedResult,
    VerifyBatch,
    VerifyInputError,
    VerifyResult,
)

LIBRARY = "sdcp_fast.kernels._native"
VERSION = 6  # csrc/sdcp_ops.cpp kNativeVersion: a stale build is refused, not half-used

ROWS_LINEAR_COLUMNS = 32  # csrc/cpu/twin.h kTwinCols
PAGED_ATTENTION_HEAD = 16  # csrc/cpu/twin.h kTwinHead: head_dim a multiple of it

log = logging.getLogger("sdcp_fast.kernels")


@cache
def unavailable_reason() -> str | None:
    """None once the op is loaded; otherwise why it cannot be (loaded at most once)."""
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or spec.origin is None:
        return "not built (no C++ compiler or torch when the package was installed?)"
    try:
        torch.ops.load_library(spec.origin)
        version = int(torch.ops.sdcp.native_version())
    except (OSError, RuntimeError, AttributeError) as exc:
        return f"cannot load {spec.origin}: {exc}"
    if version != VERSION:
        return f"stale build {spec.origin} (version {version}, want {VERSION}): rebuild with make"
    return None


@cache
def _say_unavailable_once(reason: str) -> None:
    log.warning("native CPU verify op unavailable: %s; using kernels/cpu.py", reason)


def available() -> bool:
    reason = unavailable_reason()
    if reason is not None:
        _say_unavailable_once(reason)
    return reason is None


def openmp() -> int:
    """The OpenMP version the op was built with, 0 for none (then its row and matrix loops
    run on the calling thread alone, whatever torch's thread count; the op must be available)."""
    return int(torch.ops.sdcp.openmp())


def capability() -> str:
    """The row loops the op runs now: 'avx512', 'avx2' or 'scalar' (the op must be available)."""
    return str(torch.ops.sdcp.cpu_capability())


def verify(batch: VerifyBatch) -> VerifyResult:
    """The verify op through `torch.ops.sdcp.verify` (csrc/), CPU tensors only.

    `batch` is validated; its tensors (shape and dtype of each) are listed in
    `dispatch.verify`. Returns a VerifyResult of [B] tensors: accepted and extra_token
    int64, bad_q and nan_logits bool.
    """
    try:
        accepted, extra, bad_q, nan = torch.ops.sdcp.verify(
            logits=batch.logits, draft_tokens=batch.draft_tokens, num_draft=batch.num_draft,
            rule=batch.rule, temperature_milli=batch.temperature_milli, top_k=batch.top_k,
            top_p_milli=batch.top_p_milli, q=batch.q, q_start=batch.q_start,
            accept_uniforms=batch.accept_uniforms, extra_uniforms=batch.extra_uniforms,
            row_start=batch.row_start, token_start=batch.token_start)
    except ValueError as exc:  # the op's input checks (TORCH_CHECK_VALUE)
        raise VerifyInputError(str(exc).splitlines()[0]) from exc
    return VerifyResult(accepted=accepted, extra_token=extra, bad_q=bad_q, nan_logits=nan)


def verify_packed(batch: PackedBatch) -> PackedResult:
    """`verify` on a PackedBatch's two buffers as they are (`torch.ops.sdcp.verify_packed`:
    the views are made in C++, the same checks apply), its four results in one [4, B] int64
    tensor: one op call and one read back per batch. The overload is called with positional
    arguments (keywords, or the overload packet, are parsed again on every call)."""
    try:
        packed = torch.ops.sdcp.verify_packed.default(batch.logits, batch.ints, batch.floats, batch.q,
                                                      batch.num_proposals)
    except ValueError as exc:  # the op's input checks (TORCH_CHECK_VALUE)
        raise VerifyInputError(str(exc).splitlines()[0]) from exc
    return PackedResult(packed)


def rows_linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rows_linear` takes these tensors as they are (else the caller uses the library)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and weight.shape[1] % ROWS_LINEAR_COLUMNS == 0
            and weight.is_contiguous())


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ weight[out, in].T through `torch.ops.sdcp.rows_linear` (fp32, CPU; x is made
    contiguous); ValueError for tensors it does not take (`rows_linear_fits`)."""
    if not rows_linear_fits(x, weight):
        raise ValueError(f"rows_linear: fp32 CPU x [n, in] and contiguous weight [out, in] with in a "
                         f"multiple of {ROWS_LINEAR_COLUMNS}, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    return torch.ops.sdcp.rows_linear(x.contiguous(), weight)


def int8_dot_products() -> bool:
    """Whether the op is built and the loops it chooses on this CPU have 8-bit dot products
    (AVX512-VNNI): what `q8_linear` and the twin's `activations=int8` need."""
    return available() and bool(torch.ops.sdcp.int8_dot_products())


def q8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] fp32 times an int8 weight [out, in] with one fp32 scale a row, x rounded to 8
    bits a row first, through `torch.ops.sdcp.q8_linear` (the twin's products under
    `activations=int8`); ValueError for tensors it does not take or a CPU without the dot
    products (`int8_dot_products`)."""
    return torch.ops.sdcp.q8_linear(x, weight, scale)


def q8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q8_linear` in torch, operation for operation: per row m = max|x|, q = round(x * (127 / m))
    (half to even), the products summed exactly in int64, then float(sum) * (m / 127) * scale,
    each step in fp32 as the op does it (a row of zeros gives zeros, one with NaN or inf NaNs)."""
    most = x.abs().amax(dim=1)
    finite = torch.isfinite(x).all(dim=1)
    seven = torch.tensor(127.0, dtype=torch.float32)
    safe = torch.where(finite & (most > 0), most, torch.ones_like(most))
    q = torch.round(x.nan_to_num(0.0, 0.0, 0.0) * (seven / safe)[:, None]).long()
    q = torch.where((finite & (most > 0))[:, None], q, torch.zeros_like(q))
    row_scale = torch.where(finite, torch.where(most > 0, most / seven, torch.zeros_like(most)),
                            torch.full_like(most, float("nan")))
    return ((q @ weight.long().T).float() * row_scale[:, None]) * scale[None, :]


def paged_attention_fits(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `paged_attention` takes these tensors (else the caller uses the library's)."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3
                for t in (query, keys, values))
            and keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
            and query.shape[2] == keys.shape[2] and query.shape[2] % PAGED_ATTENTION_HEAD == 0
            and query.shape[1] % keys.shape[1] == 0 and query.shape[1] // keys.shape[1] <= 64)


def paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    query_rows: torch.Tensor, query_keys: torch.Tensor, query_pages: torch.Tensor,
                    pages: torch.Tensor, page: int, scale: float) -> torch.Tensor:
    """Attention of query rows over K/V kept in pages, through `torch.ops.sdcp.paged_attention`
    (query is made contiguous); ValueError for tensors it does not take (`paged_attention_fits`)
    and for an index outside its tensors (the op's own checks)."""
    if not paged_attention_fits(query, keys, values):
        raise ValueError(f"paged_attention: fp32 CPU query [T, heads, head_dim] and contiguous keys "
                         f"and values [R, kv_heads, head_dim] with head_dim a multiple of "
                         f"{PAGED_ATTENTION_HEAD}, got {tuple(query.shape)} {query.dtype}, "
                         f"{tuple(keys.shape)} {keys.dtype}, {tuple(values.shape)} {values.dtype}")
    return torch.ops.sdcp.paged_attention(query.contiguous(), keys, values, query_rows, query_keys,
                                          query_pages, pages, page, scale)


def paged_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                              query_rows: torch.Tensor, query_keys: torch.Tensor,
                              query_pages: torch.Tensor, pages: torch.Tensor, page: int,
                              scale: float) -> torch.Tensor:
    """`paged_attention` in plain torch, one query at a time: its keys and values gathered
    from the pages, then softmax(q k^T * scale) v per head (K/V heads shared by
    heads / kv_heads query heads each)."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    out = query.new_empty(len(query_rows), heads, query.shape[2])
    for i, (row, n, first) in enumerate(zip(query_rows.tolist(), query_keys.tolist(),
                                            query_pages.tolist(), strict=True)):
        own = pages[first : first + -(-n // page)]
        at = (own[:, None] * page + torch.arange(page)).reshape(-1)[:n]
        k = keys[at].repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, head_dim]
        v = values[at].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[row], k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def target_probs(logits: torch.Tensor, temp_milli: torch.Tensor, top_k: torch.Tensor,
                 top_p_milli: torch.Tensor) -> torch.Tensor:
    """The target distribution p of every row through `torch.ops.sdcp.target_probs`.

    logits [rows, V] on the CPU, fp32, bf16 or fp16 (other float dtypes are read as fp32);
    the profile tensors [rows] int64 each, checked by `dispatch.target_probs`. Returns p
    [rows, V] fp32 (a row with NaN, +inf or no finite logit gives a NaN row).
    """
    if logits.dtype not in LOGIT_DTYPES:
        logits = logits.float()
    try:
        return torch.ops.sdcp.target_probs(logits=logits, temperature_milli=temp_milli,
                                           top_k=top_k, top_p_milli=top_p_milli)
    except ValueError as exc:
        raise VerifyInputError(str(exc).splitlines()[0]) from exc
