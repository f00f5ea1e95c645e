"""The paged K/V pool (kv_pages.py) and the grouped attention over it (hf_ragged.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from sdcp_fast.models import hf_ragged
from sdcp_fast.models.base import KVCapacityError
from sdcp_fast.models.kv_pages import MIN_PAGES, PagePool


def pool(max_pages: int = 1000, dim: int = 4) -> PagePool:
    layers, heads, page = 2, 3, 16
    return PagePool(layers, heads, dim, torch.float32, torch.device("cpu"),
                    max_bytes=max_pages * layers * 2 * page * heads * dim * 4)


def test_pages_keep_their_contents_across_growth_and_are_reused():
    p = pool()
    a = p.take(3)
    kv = torch.randn(2, 2, 3, 40, 4)
    p.write(a, 0, kv)
    assert p.allocated == MIN_PAGES
    b = p.take(MIN_PAGES)  # more than is free: the pool grows, a's pages move with it
    assert p.allocated >= MIN_PAGES + 3 and len(set(a) | set(b)) == 3 + MIN_PAGES
    torch.testing.assert_close(p.read(a, 40), kv)
    p.write(a, 38, torch.ones(2, 2, 3, 5, 4))  # positions 38..42 (into a fourth page)
    assert p.read(a, 38).equal(kv[:, :, :, :38])
    p.give_back(b)
    assert p.held == 3 and sorted(p.take(MIN_PAGES)) == sorted(b)  # given back, taken again


def test_take_over_max_bytes_raises_and_changes_nothing():
    p = pool(max_pages=10)
    a = p.take(8)
    allocated = p.allocated
    with pytest.raises(KVCapacityError, match="max_kv_bytes"):
        p.take(3)
    assert p.held == 8 and p.allocated == allocated and p.fits(2) and not p.fits(3)
    p.give_back(a)
    assert p.held == 0 and len(p.take(10)) == 10


def reference_attention(q, k, v, past):
    """q [H, T, D], k/v [Hkv, past + T, D]: causal attention with the past, query by query."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    out = []
    for t in range(q.shape[1]):
        w = torch.softmax(q[:, t : t + 1] @ k[:, : past + t + 1].transpose(1, 2) / q.shape[-1] ** 0.5, -1)
        out.append(w @ v[:, : past + t + 1])
    return torch.cat(out, 1)  # [H, T, D]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("dim", [4, 16])
def test_grouped_attention_equals_each_session_alone(seed, dim):
    """Sessions with pasts from none to hundreds of positions and runs of 1 to 9 new tokens:
    the layout splits them into fresh prompts and several groups (padding bounded), or, where
    the native op takes the pool (head_dim 16, not 4), reads the pool in place; pages taken in
    scattered order; every output equals plain attention per session."""
    rng = random.Random(seed)
    p = pool(dim=dim)
    heads, kv_heads = 6, 3
    in_place = hf_ragged.native_attention(p)
    if dim == 16 and not in_place and os.environ.get("SDCP_REQUIRE_NATIVE") != "1":
        pytest.skip("the native op is not built: only the gathered groups are tested")
    assert in_place == (dim == 16)
    junk = p.take(5)  # earlier owners' pages: stale, finite contents
    p.write(junk, 0, torch.randn(2, 2, 3, 80, dim) * 100)
    p.give_back(junk)
    spans, pasts, ks, vs, lo = [], [], [], [], 0
    for _ in range(12):
        past, run = rng.choice([0, 0, 3, 17, 40, 150, 300]), rng.choice([1, 1, 1, 5, 9])
        pages = p.take(p.pages_for(past + run))
        rng.shuffle(pages)
        k, v = torch.randn(kv_heads, past + run, dim), torch.randn(kv_heads, past + run, dim)
        if past:
            kv = torch.stack([k[:, :past], v[:, :past]])[None].repeat(2, 1, 1, 1, 1)
            p.write(pages, 0, kv)
        spans.append(hf_ragged.SpanPlan(lo, lo + run, past, pages))
        pasts.append(past)
        ks.append(k)
        vs.append(v)
        lo += run
    layout = hf_ragged.paged_layout(p, spans)
    assert layout.fresh
    if in_place:
        assert not layout.groups and not layout.in_place.all_rows
    else:
        assert len(layout.groups) >= 2 and layout.in_place is None
    query = torch.randn(1, heads, lo, dim)
    key = torch.cat([k[:, pa:] for k, pa in zip(ks, pasts, strict=True)], 1)[None]
    value = torch.cat([v[:, pa:] for v, pa in zip(vs, pasts, strict=True)], 1)[None]

    class Layer:
        layer_idx = 1

    out, _ = hf_ragged.ragged_attention(Layer(), query, key, value, None, sdcp_ragged=layout,
                                        scaling=dim ** -0.5)
    for s, pa, k, v in zip(spans, pasts, ks, vs, strict=True):
        expected = reference_attention(query[0, :, s.lo : s.hi], k, v, pa).transpose(0, 1)
        torch.testing.assert_close(out[0, s.lo : s.hi], expected, rtol=1e-4, atol=1e-5)
