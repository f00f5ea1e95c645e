"""The CPU path: vectorised torch over the whole ragged batch (no Python loop over rows).

Precision plan (agreement with the float64 reference is checked by the tests):
- Row max/argmax and NaN detection read the logits in their own dtype; one reduction gives
  all three flags (the max is NaN, +inf or -inf exactly when the row is bad).
- Top-k and top-p token *order* is decided on the upcast logits themselves, so boundary and
  tie decisions (ties keep smaller ids) are exact; only top-p's cumulative mass is a sum
  (float64 over the torch.topk candidates).
- p(x) for the acceptance test: a fused fp32 softmax per cache-sized chunk of rows without
  filters; for filtered rows exp(x - max) over the kept mass, in float64, with no full-row
  pass beyond topk. Ratio and comparison with the uniform in float64.
- The extra token: fp32 weights (p or the residual) on the one row each proposal needs, a
  float64 two-level inverse CDF (block sums, then one block).
Memory is bounded: full-width temporaries are made for at most CHUNK_ELEMENTS at a time
(the draw rows and the filtered rows' topk are [B, V] and [rows, 1024]).
"""

from __future__ import annotations

import torch

from .batch import VerifyBatch, VerifyResult

CHUNK_ELEMENTS = 1 << 18  # fp32 temporaries of 1 MiB per chunk: they stay in cache
TOP_P_CANDIDATES = 1024  # top-p looks at this many largest logits first; wider rows fall back


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row ([r, n] bool); n when there is none."""
    n = mask.shape[1]
    idx = torch.arange(n, device=mask.device).expand_as(mask)
    return torch.where(mask, idx, n).min(dim=1).values


def _keep_from_threshold(x: torch.Tensor, tau: torch.Tensor, n_keep: torch.Tensor) -> torch.Tensor:
    """Keep the n_keep largest of each row of x, ties at tau resolved to the smaller ids."""
    keep = x >= tau[:, None]
    cut = keep.sum(dim=1) > n_keep  # rows where ties at tau must be cut by id
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]
        sub = x[rows]
        above = sub > tau[rows, None]
        tied = sub == tau[rows, None]
        need_tied = n_keep[rows] - above.sum(dim=1)
        keep[rows] = above | (tied & (torch.cumsum(tied, dim=1) <= need_tied[:, None]))
    return keep


def keep_counts(x: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p_milli: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tau [r] fp32, n_keep [r] int64, kept_mass [r] float64) for rows x [r, V] fp32 with
    temperature [r] float64 > 0: each row keeps its n_keep largest logits (ties by smaller
    id), tau is the smallest kept value, kept_mass the sum of exp((x - max) / T) over them.

    Only the `width` largest values are looked at (torch.topk, no full sort); a full sort is
    the fallback for rows whose top-p prefix is longer than TOP_P_CANDIDATES tokens.
    """
    r, v = x.shape
    rows_all = torch.arange(r, device=x.device)

    def weight(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.exp((values.double() - row_max.double()[rows, None]) / temperature[rows, None])

    n_k = torch.where((top_k > 0) & (top_k < v), top_k, v)
    wants_p = top_p_milli < 1000
    width = int(torch.where(wants_p, torch.clamp(n_k, max=TOP_P_CANDIDATES), n_k).max())
    vals = torch.topk(x, width, dim=1, sorted=True).values  # [r, width] descending
    ev = weight(vals, rows_all)
    cols = torch.arange(width, device=x.device)
    n_keep = n_k.clone()
    sort_rows = torch.zeros(r, dtype=torch.bool, device=x.device)
    if bool(wants_p.any()):
        ev_k = torch.where(cols[None, :] < n_k[:, None], ev, 0.0)
        mass_k = ev_k.sum(dim=1)  # the top-k survivors' mass, when they fit the window
        no_k_wide = wants_p & (n_k == v) & (n_k > width)
        if bool(no_k_wide.any()):  # no top-k: the survivors are the whole row
            rows = no_k_wide.nonzero()[:, 0]
            mass_k[rows] = torch.exp((x[rows] - row_max[rows, None]) / temperature[rows, None].float()).sum(dim=1).double()
        reach = torch.cumsum(ev_k, dim=1) >= (top_p_milli.double() / 1000.0 * mass_k)[:, None]
        n_p = _first_true(reach) + 1  # width + 1 when the window does not reach top_p
        n_keep = torch.where(wants_p, torch.minimum(n_k, n_p), n_k)
        sort_rows = wants_p & (n_k > width) & ((n_p > width) | (n_k < v))
    n_keep = torch.clamp(n_keep, min=1, max=v)
    tau = vals.gather(1, (torch.clamp(n_keep, max=width) - 1)[:, None])[:, 0]
    kept_mass = torch.where(cols[None, :] < n_keep[:, None], ev, 0.0).sum(dim=1)
    if bool(sort_rows.any()):
        rows = sort_rows.nonzero()[:, 0]
        sv = torch.sort(x[rows], dim=1, descending=True).values
        es = weight(sv, rows)
        full_cols = torch.arange(v, device=x.device)
        es_k = torch.where(full_cols[None, :] < n_k[rows, None], es, 0.0)
        reach = torch.cumsum(es_k, dim=1) >= (top_p_milli[rows].double() / 1000.0 * es_k.sum(dim=1))[:, None]
        kept = torch.clamp(torch.minimum(n_k[rows], _first_true(reach) + 1), min=1, max=v)
        n_keep[rows] = kept
        tau[rows] = sv.gather(1, (kept - 1)[:, None])[:, 0]
        kept_mass[rows] = torch.where(full_cols[None, :] < kept[:, None], es, 0.0).sum(dim=1)
    return tau, n_keep, kept_mass


def kept_at(x: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor,
            n_keep: torch.Tensor) -> torch.Tensor:
    """Whether tokens [r] are among their row's n_keep largest (ties by smaller id)."""
    lx = x.gather(1, tokens[:, None])[:, 0]
    kept = lx > tau
    tied = lx == tau
    if bool(tied.any()):
        rows = tied.nonzero()[:, 0]
        sub = x[rows]
        ids = torch.arange(x.shape[1], device=x.device)
        rank = ((sub == tau[rows, None]) & (ids[None, :] < tokens[rows, None])).sum(dim=1)
        need = n_keep[rows] - (sub > tau[rows, None]).sum(dim=1)
        kept[rows] = rank < need
    return kept


def _row_profile(batch: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    reps = batch.num_draft + 1
    return (batch.temperature_milli.repeat_interleave(reps), batch.top_k.repeat_interleave(reps),
            batch.top_p_milli.repeat_interleave(reps))


def _filtered(temp_milli, top_k, top_p_milli, v) -> torch.Tensor:
    return (temp_milli > 0) & (((top_k > 0) & (top_k < v)) | (top_p_milli < 1000))


def _probs_rows(x: torch.Tensor, temp_milli, top_k, top_p_milli, dtype) -> torch.Tensor:
    """p for rows x ([r, V], any float dtype) in `dtype`, vectorised over the rows."""
    xf = x.float()
    row_max, arg = xf.max(dim=1)
    greedy = temp_milli == 0
    temperature = torch.where(greedy, 1, temp_milli).double() / 1000.0
    z = (xf.to(dtype) - row_max.to(dtype)[:, None]) / temperature.to(dtype)[:, None]
    e = torch.exp(z)
    filt = _filtered(temp_milli, top_k, top_p_milli, x.shape[1])
    if bool(filt.any()):
        rows = filt.nonzero()[:, 0]
        tau, n_keep, _ = keep_counts(xf[rows], row_max[rows], temperature[rows], top_k[rows],
                                     top_p_milli[rows])
        keep = _keep_from_threshold(xf[rows], tau, n_keep)
        e[rows] = torch.where(keep, e[rows], 0.0)
    p = e / e.sum(dim=1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(p).scatter_(1, arg[:, None], 1.0)
        p = torch.where(greedy[:, None], onehot, p)
    return p


def target_probs(logits: torch.Tensor, temp_milli, top_k, top_p_milli) -> torch.Tensor:
    """The target distribution p of every row, vectorised in row chunks.

    logits [rows, V] any float dtype (upcast per chunk); the profile tensors [rows] int64
    each, checked by `dispatch.target_probs`. Returns p [rows, V] fp32 on the logits' device.
    """
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for s in range(0, logits.shape[0], step):
        sl = slice(s, s + step)
        out[sl] = _probs_rows(logits[sl], temp_milli[sl], top_k[sl], top_p_milli[sl], torch.float32)
    return out


def verify(batch: VerifyBatch) -> VerifyResult:
    """The verify op in vectorised torch, on any device torch runs on.

    `batch` is validated; its tensors (shape and dtype of each) are listed in
    `dispatch.verify`. Returns a VerifyResult of [B] tensors: accepted and extra_token
    int64, bad_q and nan_logits bool.
    """
    logits = batch.logits
    b = batch.num_proposals
    n = batch.draft_tokens.shape[0]
    dev = logits.device
    temp_r, topk_r, topp_r = _row_profile(batch)
    row_max, row_arg = logits.max(dim=1)  # own dtype; ties -> first (smallest) id
    row_max = row_max.float()
    row_bad = ~torch.isfinite(row_max)  # NaN, +inf, or all -inf
    reps = batch.num_draft + 1
    owner_row = torch.arange(b, device=dev).repeat_interleave(reps)
    nan_logits = torch.zeros(b, dtype=torch.bool, device=dev).index_put_((owner_row,), row_bad, accumulate=True)

    # per draft position: its proposal, its logits row
    owner_tok = torch.arange(b, device=dev).repeat_interleave(batch.num_draft)
    pos = torch.arange(n, device=dev) - batch.token_start[owner_tok]
    tok_row = batch.row_start[owner_tok] + pos
    x = batch.draft_tokens
    rule_tok = batch.rule[owner_tok]
    is_r2 = rule_tok == 2

    # q(x) checks, before anything is drawn
    bad_q = torch.zeros(b, dtype=torch.bool, device=dev)
    qx = torch.ones(n, dtype=torch.float64, device=dev)
    if batch.q is not None and bool(is_r2.any()):
        qrow = torch.where(is_r2, batch.q_start[owner_tok] + pos, 0)
        qx = torch.where(is_r2, batch.q[qrow, x].double(), 1.0)
        bad_tok = is_r2 & ~((qx > 0) & torch.isfinite(qx))
        bad_q = bad_q.index_put_((owner_tok,), bad_tok, accumulate=True)

    # p(x) for rule-2 positions with temperature > 0 (row-chunked, bounded memory)
    px = (x == row_arg[tok_row]).double()  # greedy rows: p is one-hot on the argmax
    soft = is_r2 & (temp_r[tok_row] > 0)
    filt = soft & _filtered(temp_r[tok_row], topk_r[tok_row], topp_r[tok_row], logits.shape[1])
    if bool((soft & ~filt).any()):
        sel = (soft & ~filt).nonzero()[:, 0]
        px[sel] = _p_at(logits, tok_row[sel], x[sel], temp_r)
    if bool(filt.any()):
        sel = filt.nonzero()[:, 0]
        px[sel] = _p_at_filtered(logits, tok_row[sel], x[sel], row_max, temp_r, topk_r, topp_r)

    accept = torch.where(is_r2, batch.accept_uniforms < torch.clamp(px / qx, max=1.0),
                         x == row_arg[tok_row])
    m_max = int(batch.num_draft.max())
    dense = torch.zeros(b, m_max, dtype=torch.bool, device=dev)
    dense[owner_tok, pos] = accept
    accepted = torch.cumprod(dense.to(torch.int64), dim=1).sum(dim=1)

    flagged = nan_logits | bad_q
    accepted = torch.where(flagged, 0, accepted)
    draw_row = batch.row_start + accepted
    extra = row_arg[draw_row].to(torch.int64)
    r2 = (batch.rule == 2) & ~flagged & (batch.temperature_milli > 0)
    if bool(r2.any()):
        props = r2.nonzero()[:, 0]
        extra[props] = _draw(batch, props, accepted[props])
    extra = torch.where(flagged, -1, extra)
    return VerifyResult(accepted=accepted, extra_token=extra, bad_q=bad_q, nan_logits=nan_logits)


def _p_at(logits, rows, tokens, temp_r) -> torch.Tensor:
    """p(token) in float64 at logits rows (sorted ascending) without top-k / top-p.

    torch's fused softmax is the fastest full-row pass on CPU (one read, one write of a
    chunk small enough to stay in cache); contiguous row runs are read as views, not copied.
    """
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=logits.device)
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for s in range(0, rows.shape[0], step):
        r = rows[s: s + step]
        first, last = int(r[0]), int(r[-1])
        block = logits[first: last + 1] if last - first + 1 == r.shape[0] else logits[r]
        p = torch.softmax(_scaled(block, temp_r[r]), dim=1)
        out[s: s + step] = p.gather(1, tokens[s: s + step, None])[:, 0].double()
    return out


def _p_at_filtered(logits, rows, tokens, row_max_all, temp_r, topk_r, topp_r) -> torch.Tensor:
    """p(token) in float64 at rows with top-k / top-p: the kept set's mass comes from the
    largest values alone (keep_counts), so no full-row softmax is needed."""
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=logits.device)
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for s in range(0, rows.shape[0], step):
        r = rows[s: s + step]
        t = tokens[s: s + step]
        xf = logits[r].float()
        row_max = row_max_all[r]
        temperature = temp_r[r].double() / 1000.0
        tau, n_keep, mass = keep_counts(xf, row_max, temperature, topk_r[r], topp_r[r])
        lx = xf.gather(1, t[:, None])[:, 0].double()
        e = torch.exp((lx - row_max.double()) / temperature)
        out[s: s + step] = torch.where(kept_at(xf, t, tau, n_keep), e / mass, 0.0)
    return out


def _scaled(block: torch.Tensor, temp_milli: torch.Tensor) -> torch.Tensor:
    """logits / T in fp32 (a view of fp32 logits when every T is 1)."""
    xf = block.float()
    if bool((temp_milli == 1000).all()):
        return xf
    return xf * (1000.0 / temp_milli.float())[:, None]


def _mask_dropped(scaled, xf, temp_milli, top_k, top_p_milli) -> torch.Tensor:
    """scaled logits with the tokens that top-k / top-p drop set to -inf."""
    row_max = xf.max(dim=1).values
    tau, n_keep, _ = keep_counts(xf, row_max, temp_milli.double() / 1000.0, top_k, top_p_milli)
    return scaled.masked_fill(~_keep_from_threshold(xf, tau, n_keep), float("-inf"))


def _draw(batch: VerifyBatch, props: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The extra token of rule-2 proposals `props` (one row each): fp32 weights, float64
    cumulative sum and inverse CDF."""
    rows = batch.row_start[props] + accepted
    temp = batch.temperature_milli[props]
    block = batch.logits[rows]
    scaled = _scaled(block, temp)
    filt = _filtered(temp, batch.top_k[props], batch.top_p_milli[props], block.shape[1])
    if bool(filt.any()):
        f = filt.nonzero()[:, 0]
        scaled = scaled.clone() if scaled.data_ptr() == block.data_ptr() else scaled
        scaled[f] = _mask_dropped(scaled[f], block[f].float(), temp[f], batch.top_k[props][f],
                                  batch.top_p_milli[props][f])
    weights = torch.softmax(scaled, dim=1)
    rejected = accepted < batch.num_draft[props]
    if bool(rejected.any()):
        rj = rejected.nonzero()[:, 0]
        q = batch.q[batch.q_start[props][rj] + accepted[rj]]
        # non-finite q counts as no residual mass: map it to +inf before max(0, p - q)
        q = torch.nan_to_num(q, nan=float("inf"), neginf=float("inf"))
        res = (weights[rj] - q).clamp_(min=0.0)
        empty = res.sum(dim=1) == 0.0
        weights[rj] = torch.where(empty[:, None], weights[rj], res)
    return inverse_cdf(weights, batch.extra_uniforms[rows])


DRAW_BLOCK = 1024


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest t with cumsum(w)[t] > u * sum(w), in two levels: float64 prefix
    sums over blocks of DRAW_BLOCK tokens, then a float64 cumsum inside the one block that
    holds the target (a full-row float64 cumsum is the slowest op on CPU)."""
    r, vocab = weights.shape
    nblocks = -(-vocab // DRAW_BLOCK)
    padded = torch.nn.functional.pad(weights, (0, nblocks * DRAW_BLOCK - vocab))
    blocks = padded.view(r, nblocks, DRAW_BLOCK)
    block_cum = torch.cumsum(blocks.sum(dim=2).double(), dim=1)
    target = u * block_cum[:, -1]
    hit = torch.searchsorted(block_cum, target[:, None], right=True)[:, 0]
    last_nonempty = torch.where(block_cum > 0, torch.arange(nblocks), 0).max(dim=1).values
    hit = torch.minimum(hit, last_nonempty)  # rounding at the very top: stay in a block with mass
    before = torch.where(hit > 0, block_cum.gather(1, (hit - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = blocks[torch.arange(r), hit].double()  # [r, DRAW_BLOCK]
    inner_cum = before[:, None] + torch.cumsum(inner, dim=1)
    offset = torch.searchsorted(inner_cum, target[:, None], right=True)[:, 0]
    # rounding can leave the target past the block's own sum: its last token with mass then
    last_positive = torch.where(inner > 0, torch.arange(DRAW_BLOCK), 0).max(dim=1).values
    offset = torch.where(offset >= DRAW_BLOCK, last_positive, offset)
    return hit * DRAW_BLOCK + offset
