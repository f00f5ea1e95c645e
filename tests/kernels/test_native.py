"""What only the native op (csrc/) promises: exact decisions at their boundaries, its two row
loops and two schedules agreeing, its wide-vocabulary paths, input checks before any read, and
the fallback to kernels/cpu.py when it is not built. (The suite shared with the other paths
runs on it through the `path` fixture.)"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_matches_reference, mixed_batch, random_q, require_native
from sdcp_fast.kernels import (
    PackedBatch,
    PackedResult,
    ProposalInput,
    VerifyBatch,
    VerifyInputError,
    available_paths,
    build_batch,
    choose_path,
    native,
    pack_batch,
    target_probs,
    verify,
)
from sdcp_fast.kernels.batch import PACKED_FIELDS
from sdcp_fast.kernels.reference import trace_batch

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = [{"SDCP_NATIVE_ISA": isa, "SDCP_NATIVE_SCHEDULE": sched}
            for isa in ("auto", "avx2", "scalar") for sched in ("rows", "proposals")]


@pytest.fixture(autouse=True)
def _native():
    require_native()


def with_env(monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        if value == "auto":
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)


def test_default_path_on_cpu_is_native():
    assert choose_path(torch.device("cpu")) == "native"
    assert "native" in available_paths()
    assert native.capability() in ("avx512", "avx2", "scalar")
    with pytest.raises(VerifyInputError):
        choose_path(torch.device("cuda"), "native")


@pytest.mark.skipif(not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()),
                    reason="the op is built with OpenMP on Linux where torch has it")
def test_the_op_is_built_with_openmp_so_its_loops_use_torchs_threads():
    """Without OpenMP at compile time every split in the op (csrc/cpu/parallel.h: the verify
    rows, the twin's matrix passes) runs on the calling thread alone: a twin drafting on two
    threads ran as fast as on one."""
    assert native.openmp() > 0


def test_row_loops_and_schedules_agree(monkeypatch):
    """AVX-512, AVX2 and portable loops, rows-first and per-proposal schedules: the same
    decisions (and p within float rounding)."""
    gen = torch.Generator().manual_seed(21)
    batches = [mixed_batch(gen, vocab, torch.randint(1, 9, (12,), generator=gen).tolist(), dtype,
                           torch.device("cpu"), ties=ties)
               for vocab, dtype, ties in [(1000, torch.float32, False), (4099, torch.bfloat16, True),
                                          (3000, torch.float16, False)]]
    logits = torch.randn(64, 2500, generator=gen) * 3
    t, k, p = (torch.randint(0, n, (64,), generator=gen) for n in (1500, 2600, 1001))
    results, probs = [], []
    for env in VARIANTS:
        with_env(monkeypatch, env)
        results.append([verify(b, "native").rows() for b in batches])
        probs.append(target_probs(logits, t, k, p, path="native"))
    for got in results[1:]:
        assert got == results[0]
    for got in probs[1:]:
        assert torch.equal(got > 0, probs[0] > 0)
        assert torch.allclose(got, probs[0], rtol=1e-5, atol=1e-7, equal_nan=True)


def _at_boundaries(batch, rel: float):
    """The batch with each rule-2 proposal's deciding uniforms moved to within `rel` of the
    reference's decision boundaries: the acceptance ratio at the first position with a ratio
    below 1, then the extra-token CDF step of the drawn token."""
    acc_u = batch.accept_uniforms.clone()
    sign = 1.0
    for b, tr in enumerate(trace_batch(batch)):
        t0 = int(batch.token_start[b])
        for j, ratio in enumerate(tr.ratios):
            if 1e-3 < ratio < 1.0:
                acc_u[t0 + j] = ratio * (1.0 - sign * rel)  # just below: accept; above: reject
                sign = -sign
                break
    batch = dataclasses.replace(batch, accept_uniforms=acc_u)
    extra_u = batch.extra_uniforms.clone()
    for b, tr in enumerate(trace_batch(batch)):
        if tr.draw_cdf is None:
            continue
        cdf = tr.draw_cdf
        step = float(cdf[tr.extra_token])
        if step < 1.0:
            extra_u[int(batch.row_start[b]) + tr.accepted] = step * (1.0 - sign * rel)
            sign = -sign
    return dataclasses.replace(batch, extra_uniforms=extra_u)


@pytest.mark.parametrize("vocab,profile", [
    (1000, {}),
    (1000, {"temperature_milli": 700}),
    (1000, {"top_p_milli": 900}),
    (1000, {"temperature_milli": 1300, "top_k": 37, "top_p_milli": 900}),
    (6000, {}),
    (6000, {"top_p_milli": 950}),
])
def test_decisions_at_boundaries_match_reference(monkeypatch, vocab, profile):
    """Uniforms 1e-10 (relative) from the float64 reference's boundaries: float arithmetic
    alone cannot tell the side (its error is ~1e-7), the native op rechecks in double and must
    agree with the reference on every proposal, with no tolerance."""
    gen = torch.Generator().manual_seed(vocab + len(profile))
    ms = [3, 1, 4, 2, 5, 2, 3, 1]
    batch = mixed_batch(gen, vocab, ms, torch.float32, torch.device("cpu"),
                        rules=[2] * len(ms), profiles=[profile] * len(ms))
    batch = _at_boundaries(batch, 1e-10)
    want = [(t.accepted, t.extra_token, t.bad_q, t.nan_logits) for t in trace_batch(batch)]
    for env in VARIANTS:
        with_env(monkeypatch, env)
        assert verify(batch, "native").rows() == want, env


@pytest.mark.parametrize("profile,flat", [
    ({"top_k": 3000}, False),                      # kept list of 3000
    ({"top_k": 6000, "temperature_milli": 800}, False),  # kept set too large for a list
    ({"top_p_milli": 950}, True),                  # top-p keeps most of a flat row
    ({"top_p_milli": 900}, False),
    ({"top_k": 20000, "top_p_milli": 500}, True),  # top-k = V is off
])
def test_wide_vocabulary_paths(profile, flat):
    """V = 20000: top-k and top-p kept sets beyond the (id, weight) lists, flat rows."""
    gen = torch.Generator().manual_seed(20000 + len(profile))
    vocab, ms = 20000, [2, 1, 3]
    scale = 0.05 if flat else 2.5
    logits = torch.randn(sum(m + 1 for m in ms), vocab, generator=gen, dtype=torch.float64) * scale
    props, q_rows, row = [], [], 0
    for m in ms:
        q = random_q(gen, m, vocab, logits[row: row + m] / max(scale, 0.5))
        q_rows.append(q)
        props.append(ProposalInput(
            rule=2, tokens=torch.multinomial(q.double(), 1, generator=gen)[:, 0].tolist(),
            accept_uniforms=torch.rand(m, generator=gen, dtype=torch.float64).tolist(),
            extra_uniforms=torch.rand(m + 1, generator=gen, dtype=torch.float64).tolist(),
            sampling=profile))
        row += m + 1
    batch = build_batch(logits.float(), props, torch.cat(q_rows))
    assert assert_matches_reference(batch, verify(batch, "native")) == 0
    rows = batch.logits[:4]
    t, k, p = (torch.full((4,), profile.get(key, default)) for key, default in
               (("temperature_milli", 1000), ("top_k", 0), ("top_p_milli", 1000)))
    want = target_probs(rows, t, k, p, path="reference")
    got = target_probs(rows, t, k, p, path="native").double()
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-5)


def test_negative_q_outside_the_kept_set_holds_residual_mass():
    """reference.py counts max(0, p - q) for every finite q: a negative q outside a top-k set
    gets residual mass, so the op must read the whole q row there."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    q = torch.tensor([[0.1, 0.9, 0.0, -0.5, 0.0]])
    props = [ProposalInput(rule=2, tokens=[1], accept_uniforms=[0.99], extra_uniforms=u,
                           sampling={"top_k": 2}) for u in (0.2, 0.9)]
    batch = build_batch(torch.cat([logits, logits]), props, torch.cat([q, q]))
    assert verify(batch, "native").rows() == verify(batch, "reference").rows()
    assert [r[1] for r in verify(batch, "native").rows()] == [0, 3]


def test_float64_and_strided_inputs():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 300, generator=gen, dtype=torch.float64)
    got = target_probs(logits, 700, 50, 900, path="native")
    assert got.dtype == torch.float32
    assert torch.equal(got > 0, target_probs(logits, 700, 50, 900, path="reference") > 0)
    wide = torch.randn(6, 600, generator=gen)[:, ::2]  # not contiguous
    assert torch.equal(target_probs(wide, path="native"), target_probs(wide.contiguous(), path="native"))


def _bad_changes(batch) -> list[dict]:
    """Changes that make `batch` (two rule-2 proposals, M = 2 and 3, V = 100, five q rows)
    inconsistent: each must be refused before any read."""
    return [
        {"row_start": torch.tensor([0, 4])},                 # rows 4..7 of 7
        {"row_start": torch.tensor([0, 2])},                 # shares row 2 with proposal 0
        {"token_start": torch.tensor([0, 3])},               # tokens 3..5 of 5
        {"q_start": torch.tensor([0, 3])},                   # q rows 3..5 of 5
        {"draft_tokens": torch.tensor([0, 1, 2, 100, 4])},   # token out of range
        {"num_draft": torch.tensor([2, 0])},
        {"rule": torch.tensor([2, 3])},
        {"top_p_milli": torch.tensor([1000, 1001])},
        {"q": None},                                          # rule 2 without q rows
        {"q": torch.rand(5, 99)},                             # q of another vocabulary
        {"logits": batch.logits.long()},
    ]


def test_bad_batches_raise_before_any_read():
    """A VerifyBatch built by hand with indices past its tensors is refused, never read."""
    gen = torch.Generator().manual_seed(1)
    batch = mixed_batch(gen, 100, [2, 3], torch.float32, torch.device("cpu"), rules=[2, 2])
    for change in _bad_changes(batch):
        with pytest.raises(VerifyInputError):
            native.verify(dataclasses.replace(batch, **change))


def test_without_the_built_library_the_package_falls_back_and_says_so_once():
    code = """
import torch
import sdcp_fast.kernels.native as native
native.LIBRARY = "sdcp_fast.kernels._not_built"
from sdcp_fast import kernels
logits = torch.randn(3, 50)
p = [kernels.ProposalInput(rule=1, tokens=[1, 2], accept_uniforms=[0.1, 0.2], extra_uniforms=0.3)]
for _ in range(3):
    kernels.verify(kernels.build_batch(logits, p))
    kernels.target_probs(logits)
print(kernels.choose_path(torch.device("cpu")), kernels.available_paths())
"""
    env = {k: v for k, v in os.environ.items() if k != "SDCP_KERNELS_PATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "cpu"
    assert "native" not in out.stdout
    assert out.stderr.count("native CPU verify op unavailable") == 1, out.stderr


@pytest.mark.parametrize("how", ["no torch", "no compiler"])
def test_setup_without_torch_or_compiler_installs_without_the_op(tmp_path, how):
    """setup.py must not fail the install: an isolated build has no torch, some machines no
    compiler. It says why and builds no op; the CBOR decoder's fast path (plain C) is built
    without torch, and without a compiler is left out too."""
    args = ["build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    env = dict(os.environ)
    if how == "no torch":
        cmd = [sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
               f"sys.argv = ['setup.py', *{args!r}]; exec(open('setup.py').read())"]
    else:
        cmd = [sys.executable, "setup.py", *args]
        env.update(CC="/bin/false", CXX="/bin/false")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kernels/cpu.py serves" in out.stderr
    built = {path.name.split(".")[0] for path in tmp_path.rglob("*.so")}
    assert built == ({"_cbor_c"} if how == "no torch" else set())


def packed(batch) -> PackedBatch:
    """The same batch as pack_batch lays it out (tests build their VerifyBatches by hand too)."""
    fields = [getattr(batch, name) for name in PACKED_FIELDS]
    return PackedBatch(batch.logits, torch.cat([*fields, batch.draft_tokens]),
                       torch.cat([batch.accept_uniforms, batch.extra_uniforms]), batch.q,
                       batch.num_proposals)


def _proposals(batch) -> list[ProposalInput]:
    """A VerifyBatch's proposals as Python values (what pack_batch and build_batch take)."""
    props = []
    for b in range(batch.num_proposals):
        m, t0, r0 = (int(getattr(batch, f)[b]) for f in ("num_draft", "token_start", "row_start"))
        rule = int(batch.rule[b])
        props.append(ProposalInput(
            rule=rule, tokens=batch.draft_tokens[t0:t0 + m].tolist(),
            accept_uniforms=batch.accept_uniforms[t0:t0 + m].tolist(),
            extra_uniforms=batch.extra_uniforms[r0:r0 + m + 1].tolist(),
            sampling={k: int(getattr(batch, k)[b]) for k in ("temperature_milli", "top_k", "top_p_milli")},
            q_start=int(batch.q_start[b]) if rule == 2 else None))
    return props


def test_packed_batch_is_the_built_batch_and_verifies_alike_on_every_path(monkeypatch):
    """pack_batch lays out exactly build_batch's tensors (unpack gives them field by field),
    and a PackedBatch verifies to the same rows on every path: the native op reads the two
    buffers as they are (one [4, B] result), the others unpack them; under every row loop
    and schedule of the op."""
    gen = torch.Generator().manual_seed(44)
    cases = [mixed_batch(gen, vocab, ms, dtype, torch.device("cpu"), ties=ties)
             for vocab, ms, dtype, ties in [(50, [1], torch.float32, False),
                                            (1000, [3, 1, 4, 1, 5, 9, 2, 6], torch.float32, False),
                                            (777, [2, 7, 1, 8], torch.bfloat16, True),
                                            (300, [4] * 5, torch.float16, False)]]
    for batch in cases:
        props = _proposals(batch)
        built = build_batch(batch.logits, props, batch.q)
        pb = pack_batch(batch.logits, props, batch.q)
        assert pb.num_proposals == batch.num_proposals
        assert (pb.ints.dtype, pb.floats.dtype) == (torch.int64, torch.float64)
        unpacked = pb.unpack()
        for field in dataclasses.fields(VerifyBatch):
            want, got = getattr(built, field.name), getattr(unpacked, field.name)
            assert (want is None and got is None) or torch.equal(want, got), field.name
        assert torch.equal(pb.ints, packed(batch).ints) and torch.equal(pb.floats, packed(batch).floats)
        want = verify(built, "reference").rows()
        for path in available_paths():
            assert verify(pb, path).rows() == verify(built, path).rows(), path
        result = verify(pb, "native")
        assert isinstance(result, PackedResult) and result.packed.shape == (4, batch.num_proposals)
        assert_matches_reference(built, result)
        for env in VARIANTS:
            with_env(monkeypatch, env)
            assert verify(pb, "native").rows() == verify(built, "native").rows()
        assert want == verify(pb, "reference").rows()


def test_bad_packed_batches_raise_before_any_read():
    """verify_packed makes the same checks as verify (every index before any read) and checks
    the two buffers' own layout: VerifyInputError, never a bad read."""
    gen = torch.Generator().manual_seed(1)
    batch = mixed_batch(gen, 100, [2, 3], torch.float32, torch.device("cpu"), rules=[2, 2])
    assert native.verify_packed(packed(batch)).rows() == native.verify(batch).rows()
    for change in _bad_changes(batch):
        with pytest.raises(VerifyInputError):
            native.verify_packed(packed(dataclasses.replace(batch, **change)))
    good = packed(batch)
    layouts = [
        {"ints": good.ints.double()},                         # not int64
        {"ints": good.ints[:15]},                             # fewer than 8 fields of B
        {"ints": good.ints[:-1]},                             # one token short: floats too long
        {"floats": good.floats.float()},                      # not float64
        {"floats": good.floats[:-1]},                         # an extra uniform short
        {"floats": torch.cat([good.floats, good.floats[:1]])},
        {"num_proposals": 3},                                 # fields of 3: shifts every field
        {"num_proposals": -1},
        {"ints": good.ints.reshape(1, -1)},
    ]
    for change in layouts:
        with pytest.raises(VerifyInputError):
            native.verify_packed(dataclasses.replace(good, **change))


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_linear_is_the_linear_product_on_every_loop(monkeypatch, isa, threads):
    """Against its reference (`F.linear`, in float64): every row count a tile takes alone or
    splits (1..17), output widths off the tile and task sizes, every instruction set."""
    with_env(monkeypatch, {"SDCP_NATIVE_ISA": isa})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(7)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17):
            for out, width in ((1, 32), (67, 96), (130, 64)):
                x = torch.randn(rows, width, generator=gen)
                w = torch.randn(out, width, generator=gen)
                got = native.rows_linear(x, w)
                want = torch.nn.functional.linear(x.double(), w.double())
                assert got.dtype == torch.float32 and got.shape == (rows, out)
                torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        # a strided x is copied, not misread
        x = torch.randn(64, 6, generator=gen).t()
        w = torch.randn(10, 64, generator=gen)
        torch.testing.assert_close(native.rows_linear(x, w).double(),
                                   torch.nn.functional.linear(x.double(), w.double()), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_rows_linear_refuses_what_it_does_not_take():
    w = torch.randn(8, 64)
    for x, weight in ((torch.randn(2, 64).double(), w), (torch.randn(2, 48), torch.randn(8, 48)),
                      (torch.randn(2, 32), w), (torch.randn(2, 64), w.t().contiguous().t()),
                      (torch.randn(2, 2, 64), w)):
        assert not native.rows_linear_fits(x, weight)
        with pytest.raises(ValueError):
            native.rows_linear(x, weight)
    # the op's own checks stand behind the launcher's
    with pytest.raises(ValueError):
        torch.ops.sdcp.rows_linear(torch.randn(2, 48), torch.randn(8, 48))


def paged_case(gen, sessions, page=16, kv_heads=3, heads=9, dim=64):
    """Sessions of 1 to 300 positions with 1 to 9 queries each, pages in scattered order."""
    pages_in_pool = sum(-(-n // page) for n, _ in sessions) + 4
    keys = torch.randn(pages_in_pool * page, kv_heads, dim, generator=gen)
    values = torch.randn(pages_in_pool * page, kv_heads, dim, generator=gen)
    order = torch.randperm(pages_in_pool, generator=gen).tolist()
    rows, counts, first, pages, t = [], [], [], [], 0
    for n, run in sessions:
        own = [order.pop() for _ in range(-(-n // page))]
        for i in range(run):  # the session's last `run` positions are its queries
            rows.append(t)
            counts.append(n - run + 1 + i)
            first.append(len(pages))
            t += 1
        pages += own
    query = torch.randn(t + 2, heads, dim, generator=gen)  # two rows no query asks for
    longs = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return (query, keys, values, longs(rows), longs(counts), longs(first), longs(pages), page,
            dim ** -0.5)


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_is_attention_over_the_pages_on_every_loop(monkeypatch, isa, threads):
    """Against its reference (keys gathered from the pages, softmax in float64): one key to
    300, a page's edge and one past it, runs of queries that see one more key each, several
    query heads a K/V head; every instruction set, one and two threads."""
    with_env(monkeypatch, {"SDCP_NATIVE_ISA": isa})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        for sessions, shape in (([(1, 1), (16, 1), (17, 1), (300, 1)], {}),
                                ([(40, 6), (9, 9), (123, 1)], {}),
                                ([(33, 2), (5, 1)], {"kv_heads": 2, "heads": 2, "dim": 16})):
            case = paged_case(gen, sessions, **shape)
            got = native.paged_attention(*case)
            double = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in case]
            want = native.paged_attention_reference(*double)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_paged_attention_refuses_what_it_does_not_take():
    gen = torch.Generator().manual_seed(3)
    query, keys, values, rows, counts, first, pages, page, scale = paged_case(gen, [(20, 2)])
    # tensors the launcher sends to the library instead
    for q, k in ((query.double(), keys), (query[:, :, :8], keys[:, :, :8].contiguous()),
                 (query, keys.transpose(0, 1).contiguous().transpose(0, 1)),
                 (query[:, :4], keys)):
        assert not native.paged_attention_fits(q, k, values if k is keys else k)
        with pytest.raises(ValueError):
            native.paged_attention(q, k, values if k is keys else k, rows, counts, first, pages, page, scale)
    # an index outside the tensors: refused by the op before anything is read
    bad = [
        (rows + query.shape[0], counts, first, pages),          # a query row past T
        (rows, counts * 0, first, pages),                       # no key to see
        (rows, counts + 16 * 3, first, pages),                  # more keys than its pages hold
        (rows, counts, first + len(pages), pages),              # its pages past the list
        (rows, counts, first, pages + keys.shape[0] // page),   # a page past the pool
        (rows[:1], counts, first, pages),                       # lengths that differ
    ]
    for r, c, f, p in bad:
        with pytest.raises(ValueError):
            native.paged_attention(query, keys, values, r, c, f, p, page, scale)
    with pytest.raises(ValueError):  # keys that are not whole pages
        native.paged_attention(query, keys[:-1], values[:-1], rows, counts, first, pages, page, scale)


needs_dot_products = pytest.mark.skipif(not native.int8_dot_products(),
                                        reason="no 8-bit dot products (AVX512-VNNI) on this CPU")


@needs_dot_products
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_linear_is_its_reference_bit_for_bit(threads):
    """Sums exact in int32 and the same fp32 steps after them: equal to the torch reference
    bit for bit, for 1 to 9 rows of x (tiles of 4 and every remainder), widths of 64 columns
    and of 64 plus the masked 32, output counts off the tile of 4 and the block of 16; a row
    of zeros gives zeros, a row with NaN or inf gives NaNs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        for rows in (1, 2, 3, 4, 5, 9):
            for out, width in ((1, 32), (17, 96), (64, 576), (130, 1536)):
                x = torch.randn(rows, width, generator=gen) * torch.rand(rows, 1, generator=gen) * 50
                w = torch.randint(-127, 128, (out, width), generator=gen, dtype=torch.int8)
                scale = torch.rand(out, generator=gen) * 0.02
                if rows >= 3:
                    x[1] = 0.0
                    x[2, width // 2] = float("nan") if rows % 2 else float("inf")
                got, want = native.q8_linear(x, w, scale), native.q8_linear_reference(x, w, scale)
                assert got.dtype == torch.float32 and got.shape == (rows, out)
                assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
                if rows >= 3:
                    assert not got[1].any() and got[2].isnan().all()
    finally:
        torch.set_num_threads(before)


@needs_dot_products
def test_q8_linear_refuses_what_it_does_not_take(monkeypatch):
    x, w, scale = torch.randn(2, 64), torch.ones(8, 64, dtype=torch.int8), torch.ones(8)
    for args in ((x.double(), w, scale), (x, w.float(), scale), (x, w, scale[:4]),
                 (x[:, :48].contiguous(), w[:, :48].contiguous(), scale), (x.t().contiguous().t(), w, scale)):
        with pytest.raises(ValueError):
            native.q8_linear(*args)
    with_env(monkeypatch, {"SDCP_NATIVE_ISA": "avx2"})  # loops without the dot products
    assert not native.int8_dot_products()
    with pytest.raises(ValueError, match="8-bit dot products"):
        native.q8_linear(x, w, scale)


THREAD_COUNT_KEPT = """
import threading, torch
from sdcp_fast.kernels import native
assert native.available()
torch.get_num_threads(); torch.set_num_threads(1)   # an event loop's pin (sdcp_fast/cores.py)
def compute():                                       # the compute thread takes two cores
    torch.get_num_threads(); torch.set_num_threads(2)
t = threading.Thread(target=compute); t.start(); t.join()
x = torch.randn(4, 4096)
native.target_probs(x, torch.tensor([700] * 4), torch.tensor([0] * 4), torch.tensor([1000] * 4))
print(torch.get_num_threads())
"""


def test_the_op_keeps_the_calling_threads_torch_thread_count():
    """The op's threads come from the calling thread's count and never reset it: a thread
    pinned to one torch thread stays pinned after calling the op, though another thread set
    the process-wide count to two since (ATen's inline parallel_for would have reset it:
    csrc/cpu/parallel.h)."""
    out = subprocess.run([sys.executable, "-c", THREAD_COUNT_KEPT], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]
