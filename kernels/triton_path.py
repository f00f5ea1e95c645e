"""Fused, sorting-free Triton kernels for verify and target_probs.

Five launches, none of which writes p to global memory:
1. `_chunk_stats_kernel` [R, S]: each program reads one chunk of one logits row in its own
   dtype (upcast per block) and writes the chunk's max, argmax (smallest id), online
   sum of exp((x - max) / T), and a bad-value flag. S splits V so small batches fill the GPU.
2. `_row_finalize_kernel` [R]: combines the chunk stats into the row's max, argmax, sum and
   flag and, for rows with top-k / top-p, finds the keep threshold without sorting: a
   multi-pivot search (NPIV pivots per pass, so 32-bit keys take 8 passes) over the
   order-preserving integer keys of the fp32 values, by count (top-k) and then by mass
   (top-p); then one pass finds the id of the last kept token among ties at the threshold
   (ties keep smaller ids). A row's kept set is then {key > tau} + {key == tau, id <= tie}.
3. `_accept_kernel` [B]: flags (NaN rows, bad q(x)), the acceptance chain; q is read only at
   q[i][x[i]]; p(x) from one logits element and the row stats.
4. `_draw_partial_kernel` [B, S]: per chunk, mass of the residual max(0, p - q) and of p on
   the one row the extra token needs (the only q row read in full).
5. `_draw_final_kernel` [B]: picks the chunk holding u * mass, scans only that chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch import VerifyBatch, VerifyResult

# ---------------------------------------------------------------- launch configuration
# Every tunable of the kernels lives here.


@dataclass(frozen=True)
class LaunchConfig:
    block: int  # elements per block iteration (power of two)
    splits: int  # programs per row along V in the chunked kernels
    npiv: int = 16  # pivots per search pass (power of two)
    num_warps: int = 4
    programs: int = 8  # programs that fill the device: sizes the draw's V-split by proposals


PROGRAMS_PER_MULTIPROCESSOR = 4
# Most programs per row along V. The kernels that combine a row's chunks read all MAX_SPLITS
# slots (masked): one compiled variant for every split count, not one per power of two.
MAX_SPLITS = tl.constexpr(64)
INTERPRETER_PROGRAMS = 8  # enough splits to exercise the chunking logic in the interpreter


def multiprocessors(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None for any other device (the
    interpreter runs the kernels on CPU tensors)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(rows: int, vocab: int, device: torch.device) -> LaunchConfig:
    """Block size and V-split for `rows` rows of width `vocab` on `device`."""
    return launch_config_for(rows, vocab, multiprocessors(device))


def launch_config_for(rows: int, vocab: int, sm_count: int | None) -> LaunchConfig:
    """`launch_config` for a GPU with `sm_count` multiprocessors (None: the interpreter).
    A pure function of its arguments, so that the compile check (compile_sweep.py) can ask
    for the configurations of a GPU that is not there."""
    on_gpu = sm_count is not None
    programs = PROGRAMS_PER_MULTIPROCESSOR * sm_count if on_gpu else INTERPRETER_PROGRAMS
    block = min(1024 if on_gpu else 256, triton.next_power_of_2(vocab))
    blocks_per_row = triton.cdiv(vocab, block)
    splits = max(1, min(blocks_per_row, triton.cdiv(programs, max(rows, 1)), MAX_SPLITS.value))
    return LaunchConfig(block=block, splits=splits, num_warps=8 if block >= 1024 else 4,
                        programs=programs)


# ---------------------------------------------------------------- shared device helpers

KEY_BELOW_ALL = tl.constexpr(-(2**31))  # an integer key smaller than the key of any float (keeps everything)
SEARCH_PASSES = tl.constexpr(9)  # ceil(32 / log2(16)) + 1: enough for any 32-bit key range with 16 pivots


@triton.jit
def _ordered_key(x):
    """Integer key with the order of the fp32 values (x must not be NaN; -0.0 == +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    key = key.to(tl.int32)
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_row_block(row_ptr, offs, V):
    """A block of one logits row as fp32; NaN and padding read as -inf."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _narrow(piv, ok, j, hi, NPIV: tl.constexpr):
    """One step of a pivot search: the new [lo, hi] is [the last pivot that still satisfies
    the search, the next pivot - 1] (pivot 0 always does)."""
    top = tl.max(tl.where(ok, j, 0), axis=0)
    nxt = tl.sum(tl.where(j == top + 1, piv, 0), axis=0)
    new_hi = tl.where(top == NPIV - 1, hi, tl.minimum(nxt - 1, hi))
    lo = tl.sum(tl.where(j == top, piv, 0), axis=0)
    return lo, new_hi


@triton.jit
def _search_by_count(row_ptr, V, lo, hi, k, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """Largest key v in [lo, hi] with count(key >= v) >= k; count(key >= lo) >= k holds."""
    j = tl.arange(0, NPIV)
    for _ in range(SEARCH_PASSES):
        width = hi - lo + 1
        piv = lo + (width * j + NPIV - 1) // NPIV
        piv32 = piv.to(tl.int32)  # pivots lie in [key(-inf), key(max) + 1]: int32 compares
        cnt = tl.zeros([NPIV], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = _ordered_key(_load_row_block(row_ptr, offs, V))
            hit = (key[:, None] >= piv32[None, :]) & (offs < V)[:, None]
            cnt += tl.sum(hit.to(tl.int32), axis=0)
        lo, hi = _narrow(piv, ((cnt >= k) & (piv <= hi)) | (j == 0), j, hi, NPIV)
    return lo


@triton.jit
def _search_by_mass(row_ptr, V, lo, hi, target, m, T, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """Largest key v in [lo, hi] with mass(key >= v) >= target, or lo (whose mass is taken to
    reach the target: it is the top-k threshold or below every value)."""
    j = tl.arange(0, NPIV)
    for _ in range(SEARCH_PASSES):
        width = hi - lo + 1
        piv = lo + (width * j + NPIV - 1) // NPIV
        piv32 = piv.to(tl.int32)
        mass = tl.zeros([NPIV], dtype=tl.float64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row_block(row_ptr, offs, V)
            key = _ordered_key(x)
            e = tl.exp((x - m) / T)
            hit = (key[:, None] >= piv32[None, :]) & (offs < V)[:, None]
            mass += tl.sum(tl.where(hit, e[:, None], 0.0), axis=0).to(tl.float64)
        lo, hi = _narrow(piv, ((mass >= target) & (piv <= hi)) | (j == 0), j, hi, NPIV)
    return lo


@triton.jit
def _above(row_ptr, V, tau, m, T, BLOCK: tl.constexpr):
    """(count(key > tau), mass(key > tau), count(key == tau)) of one row."""
    n_gt = tl.zeros([BLOCK], dtype=tl.int64)
    n_eq = tl.zeros([BLOCK], dtype=tl.int64)
    mass64 = tl.sum(tl.zeros([BLOCK], dtype=tl.float64), axis=0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row_block(row_ptr, offs, V)
        key = _ordered_key(x).to(tl.int64)
        valid = offs < V
        gt = (key > tau) & valid
        n_gt += gt.to(tl.int64)
        n_eq += ((key == tau) & valid).to(tl.int64)
        mass64 += tl.sum(tl.where(gt, tl.exp((x - m) / T), 0.0), axis=0).to(tl.float64)
    return tl.sum(n_gt, axis=0), mass64, tl.sum(n_eq, axis=0)


@triton.jit
def _kept(key, offs, tau, tie_last):
    return (key > tau) | ((key == tau) & (offs <= tie_last))


# ---------------------------------------------------------------- kernels

# Specialisation: Triton compiles a kernel once per divisibility class of its arguments
# (pointers and integers divisible by 16, integers equal to 1). Two kinds of argument would
# multiply the variants and the compiles on a serving GPU without changing the code that
# matters: the split count (an index factor, never an address alignment) and the batch's
# per-proposal fields, which `pack_batch` lays out as views at offsets of 8 bytes x B or N
# into two buffers and which are only read one scalar at a time. CHUNK and V stay
# specialised: they align the vocabulary loops' vector loads.
SPLIT_COUNTS = ["SPLITS"]
BATCH_FIELDS = ["tokens_ptr", "acc_u_ptr", "num_draft_ptr", "rule_ptr", "temp_ptr", "row_start_ptr",
                "token_start_ptr", "q_start_ptr", "extra_u_ptr"]



@triton.jit(do_not_specialize=SPLIT_COUNTS)
def _chunk_stats_kernel(logits_ptr, row_temp_ptr, cmax_ptr, carg_ptr, csum_ptr, cbad_ptr,
                        V, CHUNK, SPLITS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * V
    t_milli = tl.load(row_temp_ptr + row)
    T = tl.where(t_milli == 0, 1000, t_milli).to(tl.float32) / 1000.0
    # explicit dtypes for the loop-carried scalars (the compiler needs them stable)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    arg = tl.full([], 0, tl.int32) + V
    bad = tl.full([], 0, tl.int32)
    lo = c * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        bad = bad | tl.max(((raw != raw) | (raw == float("inf"))).to(tl.int32), axis=0)
        x = tl.where(raw == raw, raw, float("-inf"))
        bm = tl.max(x, axis=0)
        barg = tl.min(tl.where(x == bm, offs, V), axis=0)
        new_m = tl.maximum(m, bm)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp((m - safe) / T) + tl.sum(tl.exp((x - safe) / T), axis=0)
        arg = tl.where(bm > m, barg, arg)  # strictly greater: the earlier block keeps ties
        m = new_m
    out = row * SPLITS + c
    tl.store(cmax_ptr + out, m)
    tl.store(carg_ptr + out, arg)
    tl.store(csum_ptr + out, s)
    tl.store(cbad_ptr + out, bad)


@triton.jit(do_not_specialize=SPLIT_COUNTS)
def _row_finalize_kernel(logits_ptr, row_temp_ptr, row_topk_ptr, row_topp_ptr,
                         cmax_ptr, carg_ptr, csum_ptr, cbad_ptr,
                         rmax_ptr, rarg_ptr, rbad_ptr, tau_ptr, tie_ptr, mass_ptr,
                         V, SPLITS, BLOCK: tl.constexpr,
                         NPIV: tl.constexpr):
    row = tl.program_id(0)
    t_milli = tl.load(row_temp_ptr + row)
    k = tl.load(row_topk_ptr + row)
    p_milli = tl.load(row_topp_ptr + row)
    T = tl.where(t_milli == 0, 1000, t_milli).to(tl.float32) / 1000.0

    # combine the chunk stats
    cs = tl.arange(0, MAX_SPLITS)
    cmask = cs < SPLITS
    cmax = tl.load(cmax_ptr + row * SPLITS + cs, mask=cmask, other=float("-inf"))
    carg = tl.load(carg_ptr + row * SPLITS + cs, mask=cmask, other=V)
    csum = tl.load(csum_ptr + row * SPLITS + cs, mask=cmask, other=0.0)
    cbad = tl.load(cbad_ptr + row * SPLITS + cs, mask=cmask, other=0)
    m = tl.max(cmax, axis=0)
    arg = tl.min(tl.where(cmax == m, carg, V), axis=0)  # ids: the smallest id among maxima
    bad = (tl.max(cbad, axis=0) > 0) | (m == float("-inf"))
    scale = tl.where(cmax == float("-inf"), 0.0, tl.exp((cmax - m) / T))
    total = tl.sum(csum * scale, axis=0).to(tl.float64)
    tl.store(rmax_ptr + row, m)
    tl.store(rarg_ptr + row, arg)
    tl.store(rbad_ptr + row, bad.to(tl.int8))

    # keep threshold (top-k then top-p), only for rows that filter
    tau = tl.full([], KEY_BELOW_ALL, tl.int64)
    tie_last = tl.full([], 0, tl.int64) + V
    kept_mass = total
    use_k = (k > 0) & (k < V)
    use_p = p_milli < 1000
    if (t_milli > 0) & (use_k | use_p) & (bad == 0):
        row_ptr = logits_ptr + row.to(tl.int64) * V
        lo = _ordered_key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        hi = _ordered_key(m).to(tl.int64)
        n_keep = tl.full([], 0, tl.int64) + V
        tau_k = lo
        if use_k:
            tau_k = _search_by_count(row_ptr, V, lo, hi, k.to(tl.int64), BLOCK, NPIV)
            n_gt, m_gt, n_eq = _above(row_ptr, V, tau_k, m, T, BLOCK)
            n_keep = k.to(tl.int64)
            kept_mass = m_gt + (n_keep - n_gt).to(tl.float64) * tl.exp((_key_value(tau_k) - m) / T).to(tl.float64)
        tau = tau_k
        if use_p:
            target = kept_mass * (p_milli.to(tl.float64) / 1000.0)
            tau_p = _search_by_mass(row_ptr, V, tau_k, hi, target, m, T, BLOCK, NPIV)
            n_gt, m_gt, n_eq = _above(row_ptr, V, tau_p, m, T, BLOCK)
            e_tau = tl.exp((_key_value(tau_p) - m) / T).to(tl.float64)
            need = tl.ceil((target - m_gt) / e_tau).to(tl.int64)
            need = tl.minimum(tl.maximum(need, 1), n_eq)
            n_p = n_gt + need
            n_keep = tl.where(tau_p == tau_k, tl.minimum(n_p, n_keep), n_p)
            tau = tau_p
            kept_mass = m_gt + (n_keep - n_gt).to(tl.float64) * e_tau
        # the id of the last kept token among the ties at tau (ties keep smaller ids)
        n_gt, m_gt, n_eq = _above(row_ptr, V, tau, m, T, BLOCK)
        want = n_keep - n_gt
        seen = tl.full([], 0, tl.int64)
        tie_last = tl.full([], 0, tl.int64) + V
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = _ordered_key(_load_row_block(logits_ptr + row.to(tl.int64) * V, offs, V)).to(tl.int64)
            eq = (key == tau) & (offs < V)
            rank = seen + tl.cumsum(eq.to(tl.int64), axis=0)
            hit = eq & (rank == want)
            tie_last = tl.minimum(tie_last, tl.min(tl.where(hit, offs, V), axis=0).to(tl.int64))
            seen += tl.sum(eq.to(tl.int64), axis=0)
    tl.store(tau_ptr + row, tau)
    tl.store(tie_ptr + row, tie_last)
    tl.store(mass_ptr + row, kept_mass)


@triton.jit(do_not_specialize_on_alignment=BATCH_FIELDS)
def _accept_kernel(logits_ptr, tokens_ptr, acc_u_ptr, num_draft_ptr, rule_ptr, temp_ptr,
                   row_start_ptr, token_start_ptr, q_ptr, q_start_ptr,
                   rmax_ptr, rarg_ptr, rbad_ptr, tau_ptr, tie_ptr, mass_ptr,
                   accepted_ptr, extra_ptr, bad_q_ptr, nan_ptr, V):
    b = tl.program_id(0)
    M = tl.load(num_draft_ptr + b)
    rule = tl.load(rule_ptr + b)
    t_milli = tl.load(temp_ptr + b)
    r0 = tl.load(row_start_ptr + b)
    t0 = tl.load(token_start_ptr + b)
    q0 = tl.load(q_start_ptr + b)
    T = tl.where(t_milli == 0, 1000, t_milli).to(tl.float32) / 1000.0

    nan = tl.full([], 0, tl.int32)
    for i in range(0, M + 1):
        nan = nan | tl.load(rbad_ptr + r0 + i).to(tl.int32)
    bad_q = tl.full([], 0, tl.int32)
    if rule == 2:
        for i in range(0, M):
            x = tl.load(tokens_ptr + t0 + i)
            qx = tl.load(q_ptr + (q0 + i) * V + x)
            good = (qx > 0.0) & (qx < float("inf"))
            bad_q = bad_q | (1 - good.to(tl.int32))

    alive = tl.full([], 1, tl.int32)
    a = tl.full([], 0, tl.int64)
    for i in range(0, M):
        row = r0 + i
        x = tl.load(tokens_ptr + t0 + i)
        arg = tl.load(rarg_ptr + row)
        ok = x == arg
        if rule == 2:
            qx = tl.load(q_ptr + (q0 + i) * V + x).to(tl.float64)
            px = ok.to(tl.float64)
            if t_milli > 0:
                lx = tl.load(logits_ptr + row * V + x).to(tl.float32)
                key = _ordered_key(lx).to(tl.int64)
                kept = _kept(key, x, tl.load(tau_ptr + row), tl.load(tie_ptr + row))
                e = tl.exp((lx - tl.load(rmax_ptr + row)) / T).to(tl.float64)
                px = tl.where(kept, e / tl.load(mass_ptr + row), 0.0)
            ratio = tl.minimum(px / qx, 1.0)
            ok = tl.load(acc_u_ptr + t0 + i) < ratio
        alive = alive & ok.to(tl.int32)
        a += alive
    flagged = (nan | bad_q) != 0
    a = tl.where(flagged, 0, a)
    extra = tl.load(rarg_ptr + r0 + a).to(tl.int64)  # rule 1, and greedy rule 2
    tl.store(accepted_ptr + b, a)
    tl.store(extra_ptr + b, tl.where(flagged, -1, extra))
    tl.store(bad_q_ptr + b, bad_q.to(tl.int8))
    tl.store(nan_ptr + b, nan.to(tl.int8))


@triton.jit
def _draw_weights(row_ptr, qrow_ptr, offs, V, tau, tie_last, m, T, kept_mass, residual):
    """(w_residual, w_p) for one block of the draw row, fp32."""
    x = _load_row_block(row_ptr, offs, V)
    key = _ordered_key(x).to(tl.int64)
    valid = offs < V
    p = tl.where(_kept(key, offs, tau, tie_last) & valid, tl.exp((x - m) / T) / kept_mass, 0.0)
    read_q = valid & ((offs * 0 + residual.to(tl.int32)) != 0)
    qv = tl.load(qrow_ptr + offs, mask=read_q, other=float("inf"))
    finite = (qv == qv) & (qv != float("inf")) & (qv != float("-inf"))
    w = tl.where(finite & (p > qv), p - qv, 0.0)
    return w, p


@triton.jit
def _draw_row(logits_ptr, q_ptr, row_start_ptr, q_start_ptr, rmax_ptr, tau_ptr, tie_ptr,
              mass_ptr, b, a, t_milli, V):
    """What both passes of the draw need about proposal b's draw row (position a + 1):
    its logits and q row, temperature, top-k/top-p threshold and tie cut-off, max, kept mass."""
    row = tl.load(row_start_ptr + b) + a
    row_ptr = logits_ptr + row * V
    qrow_ptr = q_ptr + (tl.load(q_start_ptr + b) + a) * V
    T = t_milli.to(tl.float32) / 1000.0
    tau = tl.load(tau_ptr + row)
    tie_last = tl.load(tie_ptr + row)
    m = tl.load(rmax_ptr + row)
    kept_mass = tl.load(mass_ptr + row).to(tl.float32)
    return row_ptr, qrow_ptr, T, tau, tie_last, m, kept_mass


@triton.jit(do_not_specialize=SPLIT_COUNTS, do_not_specialize_on_alignment=BATCH_FIELDS)
def _draw_partial_kernel(logits_ptr, q_ptr, num_draft_ptr, rule_ptr, temp_ptr, row_start_ptr,
                         q_start_ptr, rmax_ptr, tau_ptr, tie_ptr, mass_ptr, accepted_ptr,
                         extra_ptr, cw_ptr, cp_ptr, V, CHUNK, SPLITS, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    t_milli = tl.load(temp_ptr + b)
    eligible = (tl.load(rule_ptr + b) == 2) & (t_milli > 0) & (tl.load(extra_ptr + b) >= 0)
    sw = tl.sum(tl.zeros([BLOCK], dtype=tl.float64), axis=0)
    sp = tl.sum(tl.zeros([BLOCK], dtype=tl.float64), axis=0)
    if eligible:
        a = tl.load(accepted_ptr + b)
        residual = a < tl.load(num_draft_ptr + b)
        row_ptr, qrow_ptr, T, tau, tie_last, m, kept_mass = _draw_row(
            logits_ptr, q_ptr, row_start_ptr, q_start_ptr, rmax_ptr, tau_ptr, tie_ptr, mass_ptr,
            b, a, t_milli, V)
        lo = c * CHUNK
        for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            w, p = _draw_weights(row_ptr, qrow_ptr, offs, V, tau, tie_last, m, T, kept_mass, residual)
            sw += tl.sum(w, axis=0).to(tl.float64)
            sp += tl.sum(p, axis=0).to(tl.float64)
    tl.store(cw_ptr + b * SPLITS + c, sw)
    tl.store(cp_ptr + b * SPLITS + c, sp)


@triton.jit(do_not_specialize=SPLIT_COUNTS, do_not_specialize_on_alignment=BATCH_FIELDS)
def _draw_final_kernel(logits_ptr, q_ptr, num_draft_ptr, rule_ptr, temp_ptr, row_start_ptr,
                       q_start_ptr, extra_u_ptr, rmax_ptr, tau_ptr, tie_ptr, mass_ptr,
                       accepted_ptr, extra_ptr, cw_ptr, cp_ptr, V, CHUNK, SPLITS,
                       BLOCK: tl.constexpr):
    b = tl.program_id(0)
    t_milli = tl.load(temp_ptr + b)
    eligible = (tl.load(rule_ptr + b) == 2) & (t_milli > 0) & (tl.load(extra_ptr + b) >= 0)
    if eligible:
        a = tl.load(accepted_ptr + b)
        residual = a < tl.load(num_draft_ptr + b)
        cs = tl.arange(0, MAX_SPLITS)
        cmask = cs < SPLITS
        cw = tl.load(cw_ptr + b * SPLITS + cs, mask=cmask, other=0.0)
        cp = tl.load(cp_ptr + b * SPLITS + cs, mask=cmask, other=0.0)
        use_res = residual & (tl.sum(cw, axis=0) > 0.0)  # empty residual: draw from p
        weights = tl.where(use_res, cw, cp)
        target = tl.load(extra_u_ptr + tl.load(row_start_ptr + b) + a) * tl.sum(weights, axis=0)
        cum = tl.cumsum(weights, axis=0)
        last_nonempty = tl.max(tl.where(weights > 0.0, cs, 0), axis=0)
        chunk = tl.minimum(tl.min(tl.where((cum > target) & cmask, cs, MAX_SPLITS), axis=0), last_nonempty)
        running = tl.sum(tl.where(cs == chunk, cum - weights, 0.0), axis=0)

        row_ptr, qrow_ptr, T, tau, tie_last, m, kept_mass = _draw_row(
            logits_ptr, q_ptr, row_start_ptr, q_start_ptr, rmax_ptr, tau_ptr, tie_ptr, mass_ptr,
            b, a, t_milli, V)
        found = tl.full([], 0, tl.int64) + V
        last_positive = tl.full([], -1, tl.int64)
        lo = chunk * CHUNK
        for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            w_res, p = _draw_weights(row_ptr, qrow_ptr, offs, V, tau, tie_last, m, T, kept_mass,
                                     residual)
            w = tl.where(use_res, w_res, p).to(tl.float64)
            crossing = (running + tl.cumsum(w, axis=0) > target) & (w > 0.0)
            found = tl.minimum(found, tl.min(tl.where(crossing, offs, V), axis=0).to(tl.int64))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0.0, offs, -1), axis=0).to(tl.int64))
            running += tl.sum(w, axis=0)
        # rounding can leave u * mass past the chunk's own sum: the chunk's last token then
        token = tl.where(found < V, found, last_positive)
        tl.store(extra_ptr + b, token)


@triton.jit
def _probs_kernel(logits_ptr, row_temp_ptr, rmax_ptr, rarg_ptr, tau_ptr, tie_ptr, mass_ptr,
                  out_ptr, V, CHUNK, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    t_milli = tl.load(row_temp_ptr + row)
    T = tl.where(t_milli == 0, 1000, t_milli).to(tl.float32) / 1000.0
    row_ptr = logits_ptr + row.to(tl.int64) * V
    m = tl.load(rmax_ptr + row)
    arg = tl.load(rarg_ptr + row)
    tau = tl.load(tau_ptr + row)
    tie_last = tl.load(tie_ptr + row)
    kept_mass = tl.load(mass_ptr + row).to(tl.float32)
    lo = c * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row_block(row_ptr, offs, V)
        key = _ordered_key(x).to(tl.int64)
        p = tl.where(_kept(key, offs, tau, tie_last), tl.exp((x - m) / T) / kept_mass, 0.0)
        p = tl.where(t_milli == 0, (offs == arg).to(tl.float32), p)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, p, mask=offs < V)


# ---------------------------------------------------------------- host side


@dataclass(frozen=True)
class RowStats:
    row_max: torch.Tensor  # [R] fp32, NaN read as -inf
    row_arg: torch.Tensor  # [R] int64, argmax with ties to the smallest id
    row_bad: torch.Tensor  # [R] int8, NaN / +inf / no finite value
    tau: torch.Tensor  # [R] int64, ordered key of the smallest kept value (KEY_BELOW_ALL: all)
    tie_last: torch.Tensor  # [R] int64, largest kept id among values equal to tau
    kept_mass: torch.Tensor  # [R] float64, sum of exp((x - max) / T) over the kept tokens


def _chunking(vocab: int, splits: int, block: int) -> tuple[int, int]:
    """(chunk, splits): `splits` programs per row rounded to whole blocks of `block`."""
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    return chunk, triton.cdiv(vocab, chunk)


def row_stats(logits: torch.Tensor, row_temp: torch.Tensor, row_topk: torch.Tensor,
              row_topp: torch.Tensor, cfg: LaunchConfig) -> RowStats:
    """Per-row statistics of the target distribution p, without writing p (launches 1 and 2).

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]``, fp32, bf16 or fp16, contiguous, on the launch device.
    row_temp : torch.Tensor
        ``[R]`` int64, temperature in thousandths per row (0 = greedy).
    row_topk : torch.Tensor
        ``[R]`` int64, top-k per row (0 = off).
    row_topp : torch.Tensor
        ``[R]`` int64 in ``0..1000``, top-p in thousandths per row (1000 = off).
    cfg : LaunchConfig
        Block size, V-split and warps (see `launch_config`).

    Returns
    -------
    RowStats
        ``[R]`` tensors: max (fp32), argmax (int64), bad flag (int8), keep threshold key and
        tie cut-off (int64), kept mass (float64).
    """
    rows, vocab = logits.shape
    dev = logits.device
    chunk, splits = _chunking(vocab, cfg.splits, cfg.block)
    cmax = torch.empty(rows * splits, dtype=torch.float32, device=dev)
    carg = torch.empty(rows * splits, dtype=torch.int64, device=dev)
    csum = torch.empty(rows * splits, dtype=torch.float32, device=dev)
    cbad = torch.empty(rows * splits, dtype=torch.int32, device=dev)
    _chunk_stats_kernel[(rows, splits)](
        logits_ptr=logits, row_temp_ptr=row_temp,
        cmax_ptr=cmax, carg_ptr=carg, csum_ptr=csum, cbad_ptr=cbad,
        V=vocab, CHUNK=chunk, SPLITS=splits, BLOCK=cfg.block, num_warps=cfg.num_warps)
    stats = RowStats(
        row_max=torch.empty(rows, dtype=torch.float32, device=dev),
        row_arg=torch.empty(rows, dtype=torch.int64, device=dev),
        row_bad=torch.empty(rows, dtype=torch.int8, device=dev),
        tau=torch.empty(rows, dtype=torch.int64, device=dev),
        tie_last=torch.empty(rows, dtype=torch.int64, device=dev),
        kept_mass=torch.empty(rows, dtype=torch.float64, device=dev))
    _row_finalize_kernel[(rows,)](
        logits_ptr=logits, row_temp_ptr=row_temp, row_topk_ptr=row_topk, row_topp_ptr=row_topp,
        cmax_ptr=cmax, carg_ptr=carg, csum_ptr=csum, cbad_ptr=cbad,
        rmax_ptr=stats.row_max, rarg_ptr=stats.row_arg, rbad_ptr=stats.row_bad,
        tau_ptr=stats.tau, tie_ptr=stats.tie_last, mass_ptr=stats.kept_mass,
        V=vocab, SPLITS=splits, BLOCK=cfg.block,
        NPIV=cfg.npiv, num_warps=cfg.num_warps)
    return stats


def _contiguous_logits(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.is_contiguous() else logits.contiguous()


def verify(batch: VerifyBatch, cfg: LaunchConfig | None = None) -> VerifyResult:
    """Accepted count, extra token and flags per proposal of a ragged batch (five launches).

    Parameters
    ----------
    batch : VerifyBatch
        B proposals, N = sum(M_b) draft tokens, R = N + B logits rows, all on one device
        (layout in batch.py; `batch.validate()` has checked it):

        - ``logits`` ``[R, V]`` fp32, bf16 or fp16 (a non-contiguous tensor is copied);
        - ``draft_tokens`` ``[N]`` int64 in ``0..V-1``;
        - ``num_draft``, ``rule``, ``temperature_milli``, ``top_k``, ``top_p_milli``,
          ``q_start``, ``row_start``, ``token_start`` ``[B]`` int64;
        - ``q`` ``[Q, V]`` fp32 (rule-2 rows), or None when no proposal uses rule 2;
        - ``accept_uniforms`` ``[N]`` float64 and ``extra_uniforms`` ``[R]`` float64, in
          ``[0, 1)``.
    cfg : LaunchConfig | None
        Block size, V-split and warps; None picks `launch_config(R, V, device)`.

    Returns
    -------
    VerifyResult
        ``accepted`` ``[B]`` int64 (0 when flagged), ``extra_token`` ``[B]`` int64 (-1 when
        flagged), ``bad_q`` ``[B]`` bool, ``nan_logits`` ``[B]`` bool, on the batch's device.
    """
    logits = _contiguous_logits(batch.logits)
    rows, vocab = logits.shape
    b = batch.num_proposals
    dev = logits.device
    cfg = cfg or launch_config(rows, vocab, dev)
    reps = batch.num_draft + 1
    # per-row profile; output_size avoids a device sync
    row_temp = batch.temperature_milli.repeat_interleave(reps, output_size=rows)
    row_topk = batch.top_k.repeat_interleave(reps, output_size=rows)
    row_topp = batch.top_p_milli.repeat_interleave(reps, output_size=rows)
    stats = row_stats(logits, row_temp, row_topk, row_topp, cfg)

    q = batch.q if batch.q is not None else torch.zeros(1, vocab, dtype=torch.float32, device=dev)
    q = q if q.is_contiguous() else q.contiguous()
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    extra = torch.empty(b, dtype=torch.int64, device=dev)
    bad_q = torch.empty(b, dtype=torch.int8, device=dev)
    nan = torch.empty(b, dtype=torch.int8, device=dev)
    proposal = dict(logits_ptr=logits, num_draft_ptr=batch.num_draft, rule_ptr=batch.rule,
                    temp_ptr=batch.temperature_milli, row_start_ptr=batch.row_start,
                    q_ptr=q, q_start_ptr=batch.q_start)
    _accept_kernel[(b,)](
        **proposal, tokens_ptr=batch.draft_tokens, acc_u_ptr=batch.accept_uniforms,
        token_start_ptr=batch.token_start,
        rmax_ptr=stats.row_max, rarg_ptr=stats.row_arg, rbad_ptr=stats.row_bad,
        tau_ptr=stats.tau, tie_ptr=stats.tie_last, mass_ptr=stats.kept_mass,
        accepted_ptr=accepted, extra_ptr=extra, bad_q_ptr=bad_q, nan_ptr=nan, V=vocab)

    target_splits = max(1, min(triton.cdiv(vocab, cfg.block),
                               triton.cdiv(cfg.programs, b), MAX_SPLITS.value))
    chunk, draw_splits = _chunking(vocab, target_splits, cfg.block)
    cw = torch.empty(b * draw_splits, dtype=torch.float64, device=dev)
    cp = torch.empty(b * draw_splits, dtype=torch.float64, device=dev)
    draw = dict(**proposal, rmax_ptr=stats.row_max, tau_ptr=stats.tau, tie_ptr=stats.tie_last,
                mass_ptr=stats.kept_mass, accepted_ptr=accepted, extra_ptr=extra,
                cw_ptr=cw, cp_ptr=cp, V=vocab, CHUNK=chunk, SPLITS=draw_splits,
                BLOCK=cfg.block, num_warps=cfg.num_warps)
    _draw_partial_kernel[(b, draw_splits)](**draw)
    _draw_final_kernel[(b,)](**draw, extra_u_ptr=batch.extra_uniforms)
    return VerifyResult(accepted=accepted, extra_token=extra, bad_q=bad_q.bool(),
                        nan_logits=nan.bool())


def target_probs(logits: torch.Tensor, temp_milli: torch.Tensor, top_k: torch.Tensor,
                 top_p_milli: torch.Tensor, cfg: LaunchConfig | None = None) -> torch.Tensor:
    """The target distribution p of every logits row (launches 1, 2 and `_probs_kernel`).

    Parameters
    ----------
    logits : torch.Tensor
        ``[rows, V]``, fp32, bf16 or fp16 (a non-contiguous tensor is copied).
    temp_milli : torch.Tensor
        ``[rows]`` int64, temperature in thousandths (0 = greedy: p is one-hot on the argmax).
    top_k : torch.Tensor
        ``[rows]`` int64 (0 = off).
    top_p_milli : torch.Tensor
        ``[rows]`` int64 in ``0..1000`` (1000 = off).
    cfg : LaunchConfig | None
        Block size, V-split and warps; None picks `launch_config(rows, V, device)`.

    Returns
    -------
    torch.Tensor
        ``[rows, V]`` fp32 p on the logits' device (a row with NaN, +inf or no finite logit
        gives unspecified values: check it with `sample.bad_rows`).
    """
    logits = _contiguous_logits(logits)
    rows, vocab = logits.shape
    cfg = cfg or launch_config(rows, vocab, logits.device)
    stats = row_stats(logits, temp_milli, top_k, top_p_milli, cfg)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    chunk, splits = _chunking(vocab, cfg.splits, cfg.block)
    _probs_kernel[(rows, splits)](
        logits_ptr=logits, row_temp_ptr=temp_milli,
        rmax_ptr=stats.row_max, rarg_ptr=stats.row_arg, tau_ptr=stats.tau,
        tie_ptr=stats.tie_last, mass_ptr=stats.kept_mass, out_ptr=out,
        V=vocab, CHUNK=chunk, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return out
