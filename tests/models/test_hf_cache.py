"""The `hf:` backend's per-session KV cache, ragged batches, KV export/import, memory bounds
and spec options, on a tiny random Llama (GQA: 4 query heads, 2 KV heads) made here.

Reference: the same weights loaded a second time with transformers' stock attention, run
without a cache over the whole sequence C + x. Tolerance: 1e-4 absolute on the logits
(fp32), argmax identical (the weights are scaled up so logits are peaked).
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import VOCAB, save_model_dir, tiny_llama  # noqa: E402

from sdcp_fast.models import (  # noqa: E402
    BackendSpecError,
    KVCapacityError,
    KVImportError,
    UnknownSession,
    kvblob,
    load_backend,
)
from sdcp_fast.models.hf import HFBackend  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_model_dir(tiny_llama(), tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def reference(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def full_recompute(model, committed, proposal):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([committed + proposal])).logits[0]
    return logits[len(committed) - 1 :].float()


def assert_rows_match(rows, expected):
    assert rows.dtype == torch.float32 and rows.shape == expected.shape
    torch.testing.assert_close(rows, expected, atol=ATOL, rtol=0)
    assert torch.equal(rows.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("ragged", [True, False], ids=["packed", "one-per-forward"])
def test_cached_scoring_matches_full_recompute_over_random_traffic(llama_dir, reference, ragged):
    """Opens, batched scores of several sessions at different lengths (verifier-style M + 1
    rows and drafter-style growing proposals), partial rejections, commits and releases;
    every score is checked against a full recompute. max_batch_tokens=16 makes longer
    prefills span several passes. Half the prompts begin with a shared system prompt or
    with a live session's sequence (the packed backend copies those prefixes)."""
    be = HFBackend(llama_dir, ragged=ragged, max_batch_tokens=16)
    assert be.ragged is ragged
    rng = random.Random(20261201 + ragged)
    system = [rng.randrange(VOCAB) for _ in range(20)]
    live: dict[bytes, list[int]] = {}  # session -> its last proposal (drafters grow it)
    counter, scored_rows = 0, 0
    for _ in range(70):
        r = rng.random()
        if len(live) < 2 or (r < 0.12 and len(live) < 6):
            counter += 1
            sid = f"s{counter}".encode()
            head = rng.choice([[], system, be.committed(rng.choice(sorted(live))) if live else []])[:36]
            be.open(sid, head + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40 - len(head)))])
            live[sid] = []
            continue
        if r < 0.2:
            sid = rng.choice(sorted(live))
            be.release(sid)
            del live[sid]
            continue
        batch = rng.sample(sorted(live), rng.randint(1, len(live)))
        items = []
        for sid in batch:
            if live[sid] and rng.random() < 0.4:  # a drafter: last proposal plus one token
                x = live[sid] + [rng.randrange(VOCAB)]
            else:
                x = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 3, 5, 8]))]
            live[sid] = x
            items.append((sid, x))
        out = be.score(items)
        row = 0
        for sid, x in items:
            expected = full_recompute(reference, be.committed(sid), x)
            assert_rows_match(out[row : row + len(x) + 1], expected)
            row += len(x) + 1
            scored_rows += len(x) + 1
            if rng.random() < 0.6:  # a verdict: an accepted prefix, then the target's token
                accepted = rng.randint(0, len(x))
                extra = int(expected[accepted].argmax()) if rng.random() < 0.7 else rng.randrange(VOCAB)
                be.commit(sid, x[:accepted] + [extra])
                live[sid] = []
                if len(be.committed(sid)) > 70:  # stay under max_position_embeddings (96)
                    be.release(sid)
                    del live[sid]
        assert out.shape[0] == row
    assert scored_rows > 300
    assert (be.prefix_tokens_copied > 100) is ragged   # copies only into the pool's pages
    # K/V accounting equals what the sessions really hold
    if ragged:  # pages: each session exactly those its cached tokens need
        held = sum(be.pool.pages_for(len(be.cached_tokens(sid))) for sid in be.sessions())
        assert be.pool.held == held
        held *= be.pool.page_bytes
    else:
        held = sum(
            2 * layer.keys.numel() * layer.keys.element_size()
            for s in be._sessions.values()
            for layer in s.cache.layers
        )
    assert held == be.kv_bytes()


def test_score_computes_only_new_positions_and_commit_crops(llama_dir, reference):
    be = HFBackend(llama_dir)
    fed = []
    be.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    prompt = [5, 6, 7, 8, 9, 10, 11]
    be.open(b"a", prompt)
    assert fed == [7] and be.cached_tokens(b"a") == prompt
    be.score([(b"a", [1, 2, 3, 4, 5])])  # M + 1 = 6 rows, 5 new positions
    assert fed[-1] == 5 and be.cached_tokens(b"a") == prompt + [1, 2, 3, 4, 5]
    be.commit(b"a", [1, 2, 9])  # two accepted, a third rejected: its K/V goes
    assert be.cached_tokens(b"a") == prompt + [1, 2]
    assert be.kv_bytes() == be.pool.pages_for(9) * be.pool.page_bytes
    out = be.score([(b"a", [4, 4])])  # the committed 9, then the proposal
    assert fed[-1] == 3
    assert_rows_match(out, full_recompute(reference, prompt + [1, 2, 9], [4, 4]))
    # a drafter growing its proposal pays one position per step; earlier rows are kept
    be.open(b"b", [3, 3])
    be.score([(b"a", [4, 4, 7]), (b"b", [5, 6])])
    assert fed[-1] == 1 + 2  # b: its prompt is cached with its row, so only 5 and 6
    for s in be._sessions.values():  # own copies, not views pinning the pass's logits
        assert s.rows.untyped_storage().nbytes() == s.rows.numel() * 4
    be.release(b"a")
    with pytest.raises(UnknownSession):
        be.score([(b"a", [])])


def test_export_import_continues_identically_without_prefill(llama_dir, reference):
    a, b = HFBackend(llama_dir), HFBackend(llama_dir)
    a.open(b"s", list(range(3, 30)))
    a.score([(b"s", [7, 8, 9, 10])])
    a.commit(b"s", [7, 8, 11])
    blob = a.export_kv(b"s")
    fed = []
    b.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    b.import_kv(b"t", blob)
    assert b.committed(b"t") == a.committed(b"s")
    assert b.cached_tokens(b"t") == a.committed(b"s")[:-1]  # K/V of 29 tokens carried
    rng = random.Random(5)
    for step in range(4):
        x = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
        if step == 0:
            first = len(x)
        ra, rb = a.score([(b"s", x)]), b.score([(b"t", x)])
        assert torch.equal(ra, rb)
        tail = x[: rng.randint(0, len(x))] + [int(ra[-1].argmax())]
        a.commit(b"s", tail)
        b.commit(b"t", tail)
    assert fed[0] == first + 1  # no prefill: the last committed token and the proposal only
    assert_rows_match(b.score([(b"t", [3])]), full_recompute(reference, b.committed(b"t"), [3]))


def test_bad_blobs_are_refused_and_nothing_is_half_applied(llama_dir, tmp_path):
    a, b = HFBackend(llama_dir), HFBackend(llama_dir)
    a.open(b"s", [4, 5, 6, 7, 8])
    blob = a.export_kv(b"s")
    layers, two, heads, dim = b.kv_shape
    bad = {
        "truncated": blob[:-100],
        "corrupt": blob[:60] + bytes([blob[60] ^ 1]) + blob[61:],
        "other model": kvblob.pack("hf", b"\x01" * 32, VOCAB, [4, 5, 6, 7, 8], None, 0),
        "wrong shape": kvblob.pack("hf", b.digest, VOCAB, [4, 5, 6, 7, 8],
                                   torch.zeros(layers, two, heads + 1, 4, dim), 4),
        "wrong dtype": kvblob.pack("hf", b.digest, VOCAB, [4, 5, 6, 7, 8],
                                   torch.zeros(layers, two, heads, 4, dim, dtype=torch.bfloat16), 4),
        "tiny blob": kvblob.pack("tiny", b.digest, VOCAB, [4, 5, 6, 7, 8], None, 0),
    }
    for what, data in bad.items():
        with pytest.raises(KVImportError):
            b.import_kv(b"t", data)
        assert b.sessions() == [] and b.kv_bytes() == 0, what
    bf16 = load_backend(f"hf:{llama_dir}?dtype=bfloat16")
    assert bf16.digest != b.digest
    with pytest.raises(KVImportError, match="another model"):
        bf16.import_kv(b"t", blob)
    b.import_kv(b"t", blob)  # the good blob still imports
    assert b.cached_tokens(b"t") == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("ragged", [True, False], ids=["packed", "one-per-forward"])
def test_kv_and_length_caps_raise_before_any_change(llama_dir, reference, ragged):
    """max_kv_bytes 50 tokens: the pool holds 3 pages of 16 (48 positions), a session of
    one-by-one caches 50 positions."""
    per_token = HFBackend(llama_dir).bytes_per_token
    be = HFBackend(llama_dir, max_kv_bytes=50 * per_token, ragged=ragged)

    def kv(n):
        return be.pool.pages_for(n) * be.pool.page_bytes if ragged else n * per_token

    be.open(b"a", list(range(3, 33)))  # 30 tokens
    with pytest.raises(KVCapacityError):
        be.open(b"b", list(range(3, 28)))  # 25 more: 55 > 50
    assert be.sessions() == [b"a"] and be.kv_bytes() == kv(30)
    be.score([(b"a", [1] * 15)])  # 45 tokens
    before = be.cached_tokens(b"a")
    with pytest.raises(KVCapacityError):
        be.score([(b"a", [2] * 25)])  # 55 > 50
    assert be.cached_tokens(b"a") == before and be.kv_bytes() == kv(45)
    assert_rows_match(be.score([(b"a", [2, 3])]), full_recompute(reference, list(range(3, 33)), [2, 3]))
    blob = be.export_kv(b"a")
    with pytest.raises(KVCapacityError):
        be.import_kv(b"c", blob)  # 29 more tokens of K/V
    assert be.sessions() == [b"a"]
    short = load_backend(f"hf:{llama_dir}?max_seq_len=20")
    assert short.max_seq_len == 20
    with pytest.raises(KVCapacityError):
        short.open(b"x", [3] * 21)
    short.open(b"x", [3] * 15)
    with pytest.raises(KVCapacityError):
        short.score([(b"x", [4] * 6)])
    assert short.cached_tokens(b"x") == [3] * 15
    with pytest.raises(KVCapacityError):
        load_backend(f"hf:{llama_dir}").open(b"y", [3] * 97)  # max_position_embeddings = 96


def test_session_bytes_counts_pages_and_bytes_for_bounds_them(llama_dir):
    """What the verifier's and drafter's memory budgets read (Backend.session_bytes and
    bytes_for) on the packed path: whole pages, kept fp32 rows, two token lists."""
    from sdcp_fast.models.base import token_list_bytes
    from sdcp_fast.models.prefix_cache import MAX_ROWS

    be = HFBackend(llama_dir)
    assert be.pool is not None and be.pool.page == 16
    lists = lambda c, k: token_list_bytes(c) + token_list_bytes(k)  # noqa: E731
    kv = lambda n: be.pool.pages_for(n) * be.pool.page_bytes  # noqa: E731
    be.open(b"a", list(range(3, 23)))  # 20 tokens cached (2 pages), the row after them kept
    assert be.session_bytes(b"a") == kv(20) + 1 * VOCAB * 4 + lists(20, 20)
    be.score([(b"a", [4] * 6)])  # 26 cached, 7 rows
    assert be.session_bytes(b"a") == kv(26) + 7 * VOCAB * 4 + lists(20, 26)
    be.commit(b"a", [4, 5])  # rejected from the second: cropped to 21
    held = be.session_bytes(b"a")
    assert held == kv(21) + lists(22, 21) and held <= be.bytes_for(20 + 6 + 1)
    be.score([(b"a", [6] * 12)])  # 34 cached: a third page
    assert be.session_bytes(b"a") == 3 * be.pool.page_bytes + 13 * VOCAB * 4 + lists(22, 34)
    be.commit(b"a", [7])  # the proposal rejected, 22 kept: the third page goes back to the pool
    assert be.kv_bytes() == 2 * be.pool.page_bytes and be.pool.held == 2
    assert be.bytes_for(40) == kv(48) + MAX_ROWS * VOCAB * 4 + 2 * token_list_bytes(40)
    assert be.bytes_for(10_000) == be.bytes_for(96)  # capped at max_position_embeddings
    be.release(b"a")
    assert be.pool.held == 0 and be.kv_bytes() == 0


def test_session_bytes_counts_the_kv_as_allocated_and_bytes_for_bounds_it(llama_dir):
    """The same for models served one session per forward: K/V tensors as allocated."""
    from sdcp_fast.models.base import token_list_bytes
    from sdcp_fast.models.prefix_cache import MAX_ROWS

    be = HFBackend(llama_dir, ragged=False)
    per_token, lists = be.bytes_per_token, lambda c, k: token_list_bytes(c) + token_list_bytes(k)
    be.open(b"a", list(range(3, 23)))  # 20 tokens cached, the row after them kept
    assert be.session_bytes(b"a") == 20 * per_token + 1 * VOCAB * 4 + lists(20, 20)
    be.score([(b"a", [4] * 6)])  # 26 cached, 7 rows
    assert be.session_bytes(b"a") == 26 * per_token + 7 * VOCAB * 4 + lists(20, 26)
    be.commit(b"a", [4, 5])  # rejected from the second: cropped to 21, a view of 26 remains
    held = be.session_bytes(b"a")
    assert held == 26 * per_token + lists(22, 21)  # no row kept: C grew past them
    assert held <= be.bytes_for(20 + 6 + 1)
    be.score([(b"a", [6])])  # the next update copies: exactly the cached length again
    assert be.session_bytes(b"a") == 23 * per_token + 2 * VOCAB * 4 + lists(22, 23)
    assert be.bytes_for(40) == 40 * per_token + MAX_ROWS * VOCAB * 4 + 2 * token_list_bytes(40)
    assert be.bytes_for(10_000) == be.bytes_for(96)  # capped at max_position_embeddings


def test_spec_options(llama_dir):
    threads = torch.get_num_threads()
    try:
        be = load_backend(f"hf:{llama_dir}?dtype=bfloat16&threads=1&device=cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert be.model.dtype == torch.bfloat16 and be.bytes_per_token == HFBackend(llama_dir).bytes_per_token // 2
    be.open(b"a", [3, 4, 5])
    assert be.score([(b"a", [6])]).dtype == torch.float32
    blob = be.export_kv(b"a")
    be.import_kv(b"b", blob)  # bf16 K/V round trip
    assert be.cached_tokens(b"b") == [3, 4, 5]
    with pytest.raises(BackendSpecError, match="known: device, dtype, linear, max_kv_bytes, max_seq_len, threads"):
        load_backend(f"hf:{llama_dir}?dtpye=bfloat16")
    for bad in ("dtype=float64", "linear=fast", "threads=0", "threads=two", "max_kv_bytes=-1", "dtype", "a=1&a=2"):
        with pytest.raises(BackendSpecError):
            load_backend(f"hf:{llama_dir}?{bad}")
    with pytest.raises(BackendSpecError, match=r"known: none"):
        load_backend("tiny:demo-target?threads=2")


def test_the_backends_model_still_serves_ordinary_calls(llama_dir, reference):
    """The registered attention behaves as transformers' SDPA when called without a layout
    (e.g. by `generate`), masks included."""
    be = HFBackend(llama_dir)
    assert be.model.config._attn_implementation == "sdcp_ragged"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        cache = transformers.DynamicCache()
        be.model(input_ids=ids[:, :3], cache=cache, use_cache=True)
        got = be.model(input_ids=ids[:, 3:], cache=cache, use_cache=True).logits[0]
        want = reference(input_ids=ids).logits[0, 3:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    out = be.model.generate(ids, max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = reference.generate(ids, max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(out, ref)


def test_open_many_prefills_in_one_packed_pass_like_one_by_one(llama_dir, reference):
    """Several prompts prefilled together (the verifier's burst of session opens) hold the
    same K/V as each prefilled alone: the rows after them match a full recompute."""
    be = HFBackend(llama_dir, max_batch_tokens=16)   # 16: the burst spans several passes
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 9, 14, 5)]
    sids = [f"p{n}".encode() for n in range(len(prompts))]
    assert be.open_many(list(zip(sids, prompts, strict=True))) == [None] * len(prompts)
    rows = be.score([(sid, [3, 4]) for sid in sids])
    expected = torch.cat([full_recompute(reference, p, [3, 4]) for p in prompts])
    assert_rows_match(rows, expected)


def _alike(rng, prefix: list[int], suffixes) -> list[list[int]]:
    return [prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in suffixes]


def test_sessions_opening_alike_copy_their_common_prefix_and_score_as_computed_whole(llama_dir, reference):
    """A burst of prompts that begin alike (a system prompt): the first is prefilled alone, the
    others copy its K/V up to where they differ (one of them the same prompt: all but its last
    token) and compute the rest; one that shares fewer than PREFIX_KEY tokens is computed
    whole. Every row after them matches a full recompute, and their pages all come back."""
    from sdcp_fast.models.prefix_cache import PREFIX_KEY
    be = HFBackend(llama_dir)
    assert be.copies_prefixes
    rng = random.Random(11)
    system = [rng.randrange(VOCAB) for _ in range(PREFIX_KEY + 4)]
    prompts = _alike(rng, system, (3, 7, 1, 5))
    prompts.append(list(prompts[0]))                                      # the first prompt again
    prompts.append(system[:PREFIX_KEY - 2] + [rng.randrange(VOCAB) for _ in range(9)])   # too little alike
    sids = [f"s{n}".encode() for n in range(len(prompts))]
    assert be.open_many(list(zip(sids, prompts, strict=True))) == [None] * len(prompts)
    assert be.prefix_tokens_copied == 3 * len(system) + len(prompts[0]) - 1
    for sid, p in zip(sids, prompts, strict=True):
        assert be.cached_tokens(sid) == p[:-1] or be.cached_tokens(sid) == p
    rows = be.score([(sid, [3, 4]) for sid in sids])
    assert_rows_match(rows, torch.cat([full_recompute(reference, p, [3, 4]) for p in prompts]))
    for sid in sids:
        be.release(sid)
    assert be.pool.held == 0


def test_a_session_opening_later_copies_from_a_live_one_and_keeps_its_own(llama_dir, reference):
    """A prompt that begins like a live session's sequence (its prompt and committed output)
    copies that prefix; the copy is its own: the first session released and its pages reused,
    the second still scores as computed whole."""
    from sdcp_fast.models.prefix_cache import PREFIX_KEY
    be = HFBackend(llama_dir)
    rng = random.Random(12)
    first = [rng.randrange(VOCAB) for _ in range(PREFIX_KEY + 2)]
    be.open(b"a", first)
    be.score([(b"a", [5, 6])])
    be.commit(b"a", [5, 6])
    later = first + [5, 6, 9, 1]
    be.open(b"b", later)
    assert be.cached_tokens(b"a") == first + [5, 6]
    assert be.prefix_tokens_copied == len(first) + 2   # all the K/V a holds
    be.release(b"a")
    be.open(b"c", [rng.randrange(VOCAB) for _ in range(40)])   # takes the pages a gave back
    rows = be.score([(b"b", [7])])
    assert_rows_match(rows, full_recompute(reference, later, [7]))


def test_two_prompts_alike_prefill_together_when_a_copy_would_save_less_than_a_pass(llama_dir, reference):
    """Two new prompts sharing fewer tokens than the first one holds: no separate pass for
    the first, nothing copied; both rows as computed whole."""
    from sdcp_fast.models.prefix_cache import PREFIX_KEY
    be = HFBackend(llama_dir)
    rng = random.Random(13)
    prompts = _alike(rng, [rng.randrange(VOCAB) for _ in range(PREFIX_KEY + 1)], (20, 20))
    assert be.open_many([(b"x", prompts[0]), (b"y", prompts[1])]) == [None, None]
    assert be.prefix_tokens_copied == 0
    rows = be.score([(b"x", [2]), (b"y", [2])])
    assert_rows_match(rows, torch.cat([full_recompute(reference, p, [2]) for p in prompts]))
