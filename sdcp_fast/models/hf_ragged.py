"""One forward pass of a transformers causal LM over the new tokens of many sessions whose K/V
lives in one paged pool (kv_pages.py): a packed ragged batch, no padding of the new tokens,
no copy of any session's past into a cache of its own.

The new tokens of all sessions are packed into one row [1, T] with each token's own
position id; embeddings, projections, MLPs and the output head run once over the T tokens.
Attention goes through a function registered with transformers' `AttentionInterface` (the
extension point vLLM and TGI use). Per layer it writes the packed keys and values into the
pool at each token's row (`PagedLayout.slots`), then attends in as few SDPA calls as the
layout has groups:

  * `Fresh`: a prompt with no past attends over its own new keys, causal (no gather);
  * `Group`: sessions with a past, gathered from the pool with one `index_select` into a
    padded batch [B, kv_heads, L, head_dim], their queries padded to the group's longest run,
    one mask [B, 1, W, L] saying which key each query sees (its past and its own causal
    prefix; a padding query sees key 0 and its output is dropped).

    layout = paged_layout(pool, spans)          # once per pass, shared by every layer
    model(input_ids=[1, T], position_ids=[1, T], use_cache=False, sdcp_ragged=layout)

Where the native op is built and takes the pool (fp32 on the CPU, kernels.native), sessions
with a past skip the groups: `InPlace` lists every such query with its session's pages and
how many positions it sees, and one call of `native.paged_attention` per layer reads each key
and value where the pool keeps it, with no gather into a padded batch (which copied every
session's whole past in every layer of every pass).

Why groups: one SDPA call for B sessions replaces B calls (and B concatenations of each
session's whole past) per layer; padding costs keys no query needs, so `paged_layout` puts
sessions of like query runs and lengths together and starts a new group when padding would
more than double the group's attention work.

For a packed call transformers still builds its own causal mask over the packed row (it
sees no cache; a [1, 1, T, T] bool tensor, negligible next to the pass); the attention
function ignores it.

`supports_ragged(model)` says whether a model can take this path: its attention must go
through the interface (`_supports_attention_backend`) and be plain causal softmax attention
(no sliding window, logit soft-capping or attention sinks, which the SDPA here does not
apply). Other models are served one session per forward with their own attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_pages import PagePool

NAME = "sdcp_ragged"
MAX_GROUP_KEYS = 1 << 15  # padded key positions of one group (B x L): bounds the gather's copy
PADDING_SLACK = 2.0  # a group's padded attention work may be at most this times its real work


@dataclass(frozen=True)
class SpanPlan:
    lo: int  # packed rows lo:hi are this session's new tokens
    hi: int
    past: int  # positions the session holds before them
    pages: list[int]  # the session's pages, covering past + hi - lo positions


@dataclass(frozen=True)
class Fresh:
    lo: int
    hi: int


@dataclass(frozen=True)
class Group:
    pages: torch.Tensor  # [B * n] long: each session's first n pages (padded with its own first)
    sessions: int  # B
    length: int  # n * PAGE: keys per session after padding
    queries: torch.Tensor  # [B * W] long: packed row of each padded query (padding: row 0)
    width: int  # W: the longest run of new tokens in the group
    mask: torch.Tensor  # [B, 1, W, length] bool
    valid: torch.Tensor  # [n_real] long: which of the B * W padded queries are real
    rows: torch.Tensor  # [n_real] long: their packed rows


@dataclass(frozen=True)
class InPlace:
    """Every query of the sessions with a past, for the native op that reads their K/V where
    the pool keeps it (kernels.native.paged_attention): no gather, no padding."""

    rows: torch.Tensor  # [n] long: packed rows of the queries
    keys: torch.Tensor  # [n] long: how many positions each query sees (its past and own prefix)
    first_page: torch.Tensor  # [n] long: where its session's pages start in `pages`
    pages: torch.Tensor  # [P] long: every such session's pages, one session after another
    all_rows: bool  # rows are 0..T-1 in order: the op's output is the whole layer's


@dataclass(frozen=True)
class PagedLayout:
    pool: PagePool
    slots: torch.Tensor  # [T] long: the pool row each packed token's K/V is written to
    fresh: list[Fresh]
    groups: list[Group]
    in_place: InPlace | None = None  # instead of groups, where the native op takes the pool


def paged_layout(pool: PagePool, spans: list[SpanPlan]) -> PagedLayout:
    device = pool.pool.device
    slots: list[int] = []
    for s in spans:
        slots += pool.rows(s.pages, s.past, s.past + s.hi - s.lo)
    fresh = [Fresh(s.lo, s.hi) for s in spans if s.past == 0]
    if native_attention(pool):
        return PagedLayout(pool, torch.tensor(slots, dtype=torch.long, device=device), fresh, [],
                           _in_place(pool, [s for s in spans if s.past], len(slots)))
    rest = sorted((s for s in spans if s.past), key=lambda s: (s.hi - s.lo, s.past), reverse=True)
    groups, members = [], []
    width = length = real = 0
    for s in rest:
        w, n = s.hi - s.lo, pool.pages_for(s.past + s.hi - s.lo) * pool.page
        padded = (len(members) + 1) * max(width, w) * max(length, n)
        if members and (padded > PADDING_SLACK * (real + w * n)
                        or (len(members) + 1) * max(length, n) > MAX_GROUP_KEYS):
            groups.append(_group(pool, members, width, length, device))
            members, width, length, real = [], 0, 0, 0
        members.append(s)
        width, length, real = max(width, w), max(length, n), real + w * n
    if members:
        groups.append(_group(pool, members, width, length, device))
    return PagedLayout(pool, torch.tensor(slots, dtype=torch.long, device=device), fresh, groups)


def native_attention(pool: PagePool) -> bool:
    """Whether attention over sessions with a past reads the pool in place (the native op,
    built, taking the pool's device, dtype and head size) rather than gathering it."""
    from sdcp_fast.kernels import native

    keys = pool.keys(0)
    return native.available() and native.paged_attention_fits(keys, keys, keys)


def _longs(values, device=None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _in_place(pool: PagePool, spans: list[SpanPlan], total: int) -> InPlace:
    rows, keys, first, pages = [], [], [], []
    for s in spans:
        rows += range(s.lo, s.hi)
        keys += range(s.past + 1, s.past + 1 + s.hi - s.lo)
        first += [len(pages)] * (s.hi - s.lo)
        pages += s.pages[: pool.pages_for(s.past + s.hi - s.lo)]
    return InPlace(_longs(rows), _longs(keys), _longs(first), _longs(pages), rows == list(range(total)))


def _group(pool: PagePool, members: list[SpanPlan], width: int, length: int, device) -> Group:
    n_pages = length // pool.page
    pages, queries, valid, rows, past, runs = [], [], [], [], [], []
    for b, s in enumerate(members):
        own = s.pages[: pool.pages_for(s.past + s.hi - s.lo)]
        pages += own + [own[0]] * (n_pages - len(own))
        run = s.hi - s.lo
        queries += list(range(s.lo, s.hi)) + [0] * (width - run)
        valid += range(b * width, b * width + run)
        rows += range(s.lo, s.hi)
        past.append(s.past)
        runs.append(run)
    keys = torch.arange(length, device=device)[None, None, :]
    query = torch.arange(width, device=device)[None, :, None]
    past_t = torch.tensor(past, device=device)[:, None, None]
    runs_t = torch.tensor(runs, device=device)[:, None, None]
    real = query < runs_t
    mask = (real & (keys <= past_t + query)) | (~real & (keys == 0))
    return Group(_longs(pages, device), len(members), length, _longs(queries, device), width,
                 mask[:, None], _longs(valid, device), _longs(rows, device))


def ragged_attention(module, query, key, value, attention_mask, *, sdcp_ragged=None, **kwargs):
    """query [1, H, T, Dh], key/value [1, Hkv, T, Dh] for the packed new tokens (RoPE applied)
    -> (output [1, T, H, Dh], None)."""
    if sdcp_ragged is None:  # not our call: behave as transformers' SDPA attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layout: PagedLayout = sdcp_ragged
    pool, layer = layout.pool, module.layer_idx
    keys, values = pool.keys(layer), pool.values(layer)  # [rows, Hkv, Dh] views of the pool
    keys.index_copy_(0, layout.slots, key[0].transpose(0, 1))
    values.index_copy_(0, layout.slots, value[0].transpose(0, 1))
    # torch's SDPA directly, grouped-query heads without copies (enable_gqa); transformers'
    # wrapper repeats K/V whenever there is a mask
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    gqa, scale = heads != kv_heads, kwargs.get("scaling")
    p, in_place = layout.in_place, None
    if p is not None and len(p.rows):   # the sessions with a past, read where the pool keeps them
        from sdcp_fast.kernels import native

        in_place = native.paged_attention(query[0].transpose(0, 1), keys, values, p.rows, p.keys,
                                          p.first_page, p.pages, pool.page,
                                          dim ** -0.5 if scale is None else scale)
        if p.all_rows:   # no fresh prompt in the pass: that is the whole layer's output
            return in_place[None], None
    out = query.new_empty(query.shape[2], heads, dim)  # [T, H, Dh]
    for f in layout.fresh:
        lo, hi = f.lo, f.hi
        out[lo:hi] = F.scaled_dot_product_attention(
            query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], is_causal=hi - lo > 1,
            scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
    if in_place is not None:
        out.index_copy_(0, p.rows, in_place)
    paged_k = keys.view(-1, pool.page, kv_heads, dim)
    paged_v = values.view(-1, pool.page, kv_heads, dim)
    for g in layout.groups:
        b = g.sessions
        k = paged_k.index_select(0, g.pages).view(b, g.length, kv_heads, dim).transpose(1, 2)
        v = paged_v.index_select(0, g.pages).view(b, g.length, kv_heads, dim).transpose(1, 2)
        q = query[0].index_select(1, g.queries).view(heads, b, g.width, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, g.rows, o.transpose(1, 2).reshape(b * g.width, heads, dim).index_select(0, g.valid))
    return out[None], None


def register() -> None:
    """Register the attention function, and SDPA's mask builder under the same name, so
    that an ordinary call of the model (no layout) behaves exactly as "sdpa"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, ragged_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def supports_ragged(model) -> bool:
    if not getattr(model, "_supports_attention_backend", False):
        return False
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # e.g. Qwen2 keeps a sliding_window value it does not use
        full = all(t == "full_attention" for t in layer_types)
    else:
        full = not getattr(config, "sliding_window", None)
    return full and not getattr(config, "attn_logit_softcapping", None)
