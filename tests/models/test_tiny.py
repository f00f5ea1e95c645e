"""The built-in backend: ragged batched scoring, KV reuse and truncation, capacity errors.

Tolerance: fp32 logits (magnitudes up to ~30 here) agree within atol 1e-4, rtol 1e-5 between
the packed batch, single-session scoring and the dense no-cache forward: they differ only in
matmul blocking (measured max difference ~2e-6).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdcp_fast.models import (
    InvalidTokens,
    KVCapacityError,
    ModelError,
    SessionExists,
    UnknownSession,
    load_backend,
)
from sdcp_fast.models.base import common_prefix_length
from sdcp_fast.models.weights import load_tiny

TOL = {"atol": 1e-4, "rtol": 1e-5}

PROMPTS = {
    b"a": [1, 2, 3, 4, 5, 6, 7],
    b"b": [200],
    b"c": [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 40],
    b"d": [17, 18],
}
PROPOSALS = {b"a": [10, 11, 12], b"b": [], b"c": [1, 2, 3, 4, 5, 6, 7, 8], b"d": [255]}


def no_cache_rows(model, committed, proposal):
    """Reference: dense causal forward over C + x, no KV cache; rows after C, ..., C + x."""
    full = committed + proposal
    with torch.no_grad():
        logits = model.forward_train(torch.tensor([full]))[0]
    return logits[len(committed) - 1 :]


def open_all(backend):
    for sid, prompt in PROMPTS.items():
        backend.open(sid, prompt)


def test_batched_equals_alone_equals_no_cache(tiny_path):
    model, _ = load_tiny(tiny_path)
    batched = load_backend(f"tiny:{tiny_path}")
    open_all(batched)
    out = batched.score(list(PROPOSALS.items()))
    assert out.dtype == torch.float32
    assert out.shape == (sum(len(x) + 1 for x in PROPOSALS.values()), 256)

    row = 0
    for sid, x in PROPOSALS.items():
        alone = load_backend(f"tiny:{tiny_path}")
        alone.open(sid, PROMPTS[sid])
        single = alone.score([(sid, x)])
        expect = no_cache_rows(model, PROMPTS[sid], x)
        torch.testing.assert_close(out[row : row + len(x) + 1], single, **TOL)
        torch.testing.assert_close(single, expect, **TOL)
        row += len(x) + 1


def test_one_forward_pass_for_the_whole_batch(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    open_all(be)
    be.commit(b"a", [50])  # so session a needs its last committed token recomputed
    counter = CountingModel(be)
    be.score(list(PROPOSALS.items()))
    # b's only row is cached from its prefill, so b feeds nothing; a feeds 50 + proposal
    assert counter.calls == [[4, 8, 1]]


def test_scoring_does_not_change_committed_and_is_repeatable(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    open_all(be)
    first = be.score(list(PROPOSALS.items()))
    again = be.score(list(PROPOSALS.items()))  # everything cached now: same rows back
    assert torch.equal(first, again)
    assert be.committed(b"a") == PROMPTS[b"a"]
    # a different proposal on the same session replaces the cached speculative positions
    model, _ = load_tiny(tiny_path)
    other = be.score([(b"a", [99, 98])])
    torch.testing.assert_close(other, no_cache_rows(model, PROMPTS[b"a"], [99, 98]), **TOL)
    assert be.cached_tokens(b"a") == PROMPTS[b"a"] + [99, 98]


class CountingModel:
    """Wraps forward_cached to record how many new tokens each session fed."""

    def __init__(self, backend):
        self.calls: list[list[int]] = []
        inner = backend.model.forward_cached

        def forward_cached(batch, rows=None):
            self.calls.append(
                [batch.starts[i + 1] - batch.starts[i] for i in range(len(batch.caches))]
            )
            return inner(batch, rows)

        backend.model.forward_cached = forward_cached


def test_drafter_growing_proposal_computes_only_the_new_token(tiny_path):
    model, _ = load_tiny(tiny_path)
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [5, 6, 7])
    counter = CountingModel(be)
    proposal: list[int] = []
    for step in range(6):
        rows = be.score([(b"s", proposal)])
        assert rows.shape[0] == len(proposal) + 1
        torch.testing.assert_close(rows, no_cache_rows(model, [5, 6, 7], proposal), **TOL)
        proposal.append(int(rows[-1].argmax()))
        if step == 0:
            assert counter.calls == []  # the prefill already produced the first row
    assert counter.calls == [[1]] * 5


def test_verifier_round_feeds_last_committed_plus_proposal(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [5, 6, 7])
    be.commit(b"s", [8])  # e.g. a bonus token the verifier sampled: not in the cache yet
    counter = CountingModel(be)
    be.score([(b"s", [1, 2, 3, 4])])
    assert counter.calls == [[5]]  # M + 1 = 5 positions: token 8 and the four proposed


def test_partial_acceptance_then_continue_equals_fresh_prefill(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [30, 31, 32, 33])
    be.score([(b"s", [40, 41, 42, 43, 44])])
    assert be.cached_tokens(b"s") == [30, 31, 32, 33, 40, 41, 42, 43, 44]
    # verdict: two accepted, then the target's own token 77 instead of 42
    be.commit(b"s", [40, 41, 77])
    assert be.committed(b"s") == [30, 31, 32, 33, 40, 41, 77]
    assert be.cached_tokens(b"s") == [30, 31, 32, 33, 40, 41]  # rejected positions dropped
    continued = be.score([(b"s", [50, 51, 52])])

    fresh = load_backend(f"tiny:{tiny_path}")
    fresh.open(b"s", [30, 31, 32, 33, 40, 41, 77])
    torch.testing.assert_close(continued, fresh.score([(b"s", [50, 51, 52])]), **TOL)


def test_commit_keeps_consistent_speculative_positions(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [1, 2])
    be.score([(b"s", [3, 4, 5])])
    be.commit(b"s", [3])  # accepted a prefix; the rest is not contradicted
    assert be.cached_tokens(b"s") == [1, 2, 3, 4, 5]
    counter = CountingModel(be)
    be.score([(b"s", [4, 5])])
    assert counter.calls == []  # every row was cached
    be.commit(b"s", [4, 9])
    assert be.cached_tokens(b"s") == [1, 2, 3, 4]


def test_all_accepted_plus_bonus(tiny_path):
    model, _ = load_tiny(tiny_path)
    be = load_backend(f"tiny:{tiny_path}")
    be.open(b"s", [1, 2])
    be.score([(b"s", [3, 4])])
    be.commit(b"s", [3, 4, 8])
    rows = be.score([(b"s", [6])])
    torch.testing.assert_close(rows, no_cache_rows(model, [1, 2, 3, 4, 8], [6]), **TOL)


def test_sessions_are_independent_across_interleaved_rounds(tiny_path):
    model, _ = load_tiny(tiny_path)
    be = load_backend(f"tiny:{tiny_path}")
    open_all(be)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        items = []
        for sid in PROMPTS:
            n = int(torch.randint(0, 4, (), generator=gen))
            items.append((sid, torch.randint(0, 256, (n,), generator=gen).tolist()))
        out = be.score(items)
        row = 0
        for sid, x in items:
            expect = no_cache_rows(model, be.committed(sid), x)
            torch.testing.assert_close(out[row : row + len(x) + 1], expect, **TOL)
            row += len(x) + 1
            keep = int(torch.randint(0, len(x) + 1, (), generator=gen))
            be.commit(sid, x[:keep] + [int(torch.randint(0, 256, (), generator=gen))])


def test_kv_cap_raises_before_changing_state(tiny_path):
    probe = load_backend(f"tiny:{tiny_path}")
    per_position = 4 * 2 * 2 * 32  # fp32, 2 layers, K and V, d_model 32
    be = load_backend(f"tiny:{tiny_path}", max_kv_bytes=64 * per_position)  # one buffer
    be.open(b"a", [1, 2, 3])
    assert be.kv_bytes() == 64 * per_position
    with pytest.raises(KVCapacityError, match="max_kv_bytes"):
        be.open(b"b", [1])
    assert be.sessions() == [b"a"]
    with pytest.raises(KVCapacityError):
        be.score([(b"a", list(range(70)))])  # would grow the buffer to 128 positions
    assert be.cached_tokens(b"a") == [1, 2, 3]
    be.release(b"a")
    be.open(b"b", [1])  # memory came back
    assert probe.kv_bytes() == 0


def test_sequence_longer_than_max_seq_len(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")  # SMALL.max_seq_len = 128
    with pytest.raises(KVCapacityError, match="max_seq_len"):
        be.open(b"a", [1] * 129)
    be.open(b"a", [1] * 120)
    with pytest.raises(KVCapacityError):
        be.score([(b"a", [2] * 9)])
    be.score([(b"a", [2] * 8)])


def test_errors(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    with pytest.raises(InvalidTokens):
        be.open(b"a", [])
    with pytest.raises(InvalidTokens):
        be.open(b"a", [256])
    be.open(b"a", [1])
    with pytest.raises(SessionExists):
        be.open(b"a", [1])
    with pytest.raises(UnknownSession):
        be.score([(b"zz", [])])
    with pytest.raises(InvalidTokens):
        be.score([(b"a", [-1])])
    with pytest.raises(ModelError, match="twice"):
        be.score([(b"a", []), (b"a", [1])])
    with pytest.raises(InvalidTokens):
        be.commit(b"a", [1000])
    be.release(b"a")
    with pytest.raises(UnknownSession):
        be.release(b"a")
    with pytest.raises(UnknownSession):
        be.committed(b"a")


def test_text_roundtrip(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    assert be.encode("héllo") == list("héllo".encode())
    assert be.decode(be.encode("héllo")) == "héllo"
    assert be.decode([0xC3]) == "\ufffd"  # a split UTF-8 sequence never raises


def test_empty_batch(tiny_path):
    assert load_backend(f"tiny:{tiny_path}").score([]).shape == (0, 256)


def test_kv_bytes_accounting_follows_allocations_and_releases(tiny_path):
    be = load_backend(f"tiny:{tiny_path}")
    per_position = 4 * 2 * 2 * 32
    be.open(b"a", [1] * 10)  # 64-position buffer
    be.open(b"b", [1] * 70)  # 128
    assert be.kv_bytes() == (64 + 128) * per_position
    be.score([(b"a", [2] * 60)])  # grows a to 128
    assert be.kv_bytes() == 256 * per_position
    blob = be.export_kv(b"b")
    be.release(b"b")
    assert be.kv_bytes() == 128 * per_position
    be.import_kv(b"c", blob)
    assert be.kv_bytes() == 256 * per_position
    for sid in (b"a", b"c"):
        be.release(sid)
    assert be.kv_bytes() == 0


@given(
    st.lists(st.integers(0, 2), max_size=12),
    st.lists(st.integers(0, 2), max_size=12),
)
def test_common_prefix_length(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_length(a, b) == common_prefix_length(b, a) == n
