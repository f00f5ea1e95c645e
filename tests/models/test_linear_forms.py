"""Linear layers in the form measured faster (models/linear_forms.py): both forms compute
nn.Linear's product (fp32 tolerance 1e-5), the chooser settles on the form its clock says is
faster per row count and follows a change, and the swap keeps the model's parameters, names
and ties. The `hf:` backend with a tiny Llama scores the same with `linear=measured` as with
`linear=library`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdcp_fast.models import linear_forms as lf

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 17, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("width", [24, 64])   # 24: not a multiple of the native op's 32 columns
def test_both_forms_compute_the_linear_product(rows, bias, streamed, width):
    if streamed and not lf.streamed_available():
        pytest.skip("the native op is not built")
    torch.manual_seed(rows)
    layer = nn.Linear(width, 40, bias=bias)
    chooser = lf.FormChooser(streamed=streamed)
    measured = lf.MeasuredLinear(layer, chooser)
    x = torch.randn(3, rows, width)
    want = layer(x)
    for form in (lf.LIBRARY, lf.SECOND):
        chooser.current = form
        got = measured(x)
        assert got.shape == (3, rows, 40) and got.is_contiguous()
        torch.testing.assert_close(got, want, **TOL)
    chooser.current = None


class FakeClock:
    """A clock the test moves: each pass costs what `cost[form]` says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_passes(chooser, clock, rows, cost, n):
    forms = []
    for _ in range(n):
        with chooser.pass_over(rows) as form:
            clock.now += cost[form]
        forms.append(form)
    return forms


def test_chooser_alternates_then_keeps_the_faster_form_and_rechecks():
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock, streamed=False)
    cost = {lf.LIBRARY: 0.060, lf.SECOND: 0.040}
    warm = run_passes(chooser, clock, 1, cost, 2 * lf.WARMUP)
    assert warm == [lf.LIBRARY, lf.SECOND] * lf.WARMUP
    assert chooser.chosen() == {1: "weight_major"}
    steady = run_passes(chooser, clock, 1, cost, lf.RECHECK)
    # one pass in RECHECK runs the other form; every other runs the chosen one
    assert steady.count(lf.LIBRARY) == 1
    # another row count decides for itself
    run_passes(chooser, clock, 8, {lf.LIBRARY: 0.05, lf.SECOND: 0.09}, 2 * lf.WARMUP)
    assert chooser.chosen() == {1: "weight_major", 8: "library"}
    assert chooser.settled(8) == lf.LIBRARY and chooser.settled(3) == lf.LIBRARY


def test_chooser_follows_a_change_of_costs():
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock, streamed=True)
    run_passes(chooser, clock, 4, {lf.LIBRARY: 0.060, lf.SECOND: 0.040}, 2 * lf.WARMUP)
    assert chooser.chosen() == {4: "streamed"}
    # the machine changes: the chosen form's own new timings move its median past the other's,
    # and both forms, alternating afresh, confirm the change
    flipped = {lf.LIBRARY: 0.030, lf.SECOND: 0.080}
    run_passes(chooser, clock, 4, flipped, lf.SAMPLES // 2 + 1)
    assert chooser.chosen() == {4: "streamed"}
    confirming = run_passes(chooser, clock, 4, flipped, 2 * lf.WARMUP)
    assert sorted(confirming) == [lf.LIBRARY] * lf.WARMUP + [lf.SECOND] * lf.WARMUP
    assert chooser.chosen() == {4: "library"}
    # and back
    run_passes(chooser, clock, 4, {lf.LIBRARY: 0.090, lf.SECOND: 0.020}, lf.SAMPLES + 2 * lf.WARMUP)
    assert chooser.chosen() == {4: "streamed"}


def test_passes_slowed_for_a_while_do_not_hold_a_row_count_in_the_dearer_form():
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock, streamed=True)
    costs = {lf.LIBRARY: 0.200, lf.SECOND: 0.110}
    run_passes(chooser, clock, 8, costs, 2 * lf.WARMUP)
    assert chooser.chosen() == {8: "streamed"}
    # seven passes in a row slowed by other work (the streamed form's, as it is chosen)
    run_passes(chooser, clock, 8, {lf.LIBRARY: 0.600, lf.SECOND: 0.550}, lf.SAMPLES)
    # then the machine is quiet again: the side-by-side confirmation keeps the streamed form
    forms = run_passes(chooser, clock, 8, costs, 2 * lf.WARMUP + 20)
    assert chooser.chosen() == {8: "streamed"}
    assert forms[2 * lf.WARMUP:].count(lf.LIBRARY) == 0


def test_passes_over_more_rows_than_the_streamed_form_serves_choose_weight_major_or_the_library():
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock, streamed=True)
    rows = lf.STREAMED_ROWS + 1
    forms = run_passes(chooser, clock, rows, {lf.LIBRARY: 0.05, lf.SECOND: 0.01}, 2 * lf.WARMUP)
    assert forms == [lf.LIBRARY, lf.SECOND] * lf.WARMUP
    assert chooser.chosen() == {rows: "weight_major"} and chooser.settled(rows) == lf.SECOND
    # the largest streamed row count keeps a key of its own, and chooses for itself
    run_passes(chooser, clock, lf.STREAMED_ROWS, {lf.LIBRARY: 0.01, lf.SECOND: 0.05}, 2 * lf.WARMUP)
    assert chooser.chosen() == {rows: "weight_major", lf.STREAMED_ROWS: "library"}
    # a wide pass (a prefill's rows) chooses in its band likewise
    run_passes(chooser, clock, 300, {lf.LIBRARY: 0.30, lf.SECOND: 0.40}, 2 * lf.WARMUP)
    assert chooser.settled(290) == lf.LIBRARY


def test_the_second_form_above_the_streamed_rows_is_weight_major():
    if not lf.streamed_available():
        pytest.skip("the native op is not built")
    torch.manual_seed(3)
    layer = nn.Linear(64, 40, bias=False)
    chooser = lf.FormChooser(streamed=True)
    measured = lf.MeasuredLinear(layer, chooser)
    x = torch.randn(lf.STREAMED_ROWS + 1, 64)
    chooser.current = lf.SECOND
    got = measured(x)
    chooser.current = None
    torch.testing.assert_close(got, lf.weight_major(x, layer.weight), rtol=0, atol=0)


def test_a_failed_pass_is_not_timed():
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock)
    with pytest.raises(RuntimeError), chooser.pass_over(3):
        clock.now += 100.0
        raise RuntimeError("backend failure")
    assert chooser.current is None
    run_passes(chooser, clock, 3, {lf.LIBRARY: 0.01, lf.SECOND: 0.02}, 2 * lf.WARMUP)
    assert chooser.chosen() == {3: "library"}


def test_rows_keys_are_exact_then_banded():
    assert [lf.rows_key(n) for n in (1, 9, 16)] == [1, 9, 16]
    assert [lf.rows_key(n) for n in (17, 18, 31, 64, 100, 1000)] == [17, 18, 30, 64, 96, 960]
    # a band is at most an eighth of its row counts wide
    for n in range(17, 5000):
        assert n * 7 / 8 <= lf.rows_key(n) <= n
    # no band holds row counts on both sides of the streamed form's limit
    assert lf.rows_key(lf.STREAMED_ROWS + 1) > lf.STREAMED_ROWS


def test_long_passes_choose_per_call_and_per_layer_shape(monkeypatch):
    clock = FakeClock()
    chooser = lf.FormChooser(clock=clock, streamed=False)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)).eval()
    x = torch.randn(300, 16)
    want = model(x)
    lf.measure_linear_forms(model, chooser)
    # what each form of each layer shape costs on the fake clock for 300 rows (by out
    # features; in proportion to the rows): the wider layer is cheaper weight-major, the
    # narrower one in the library's form
    cost = {(lf.LIBRARY, 32): 0.020, (lf.SECOND, 32): 0.010, (lf.LIBRARY, 16): 0.010, (lf.SECOND, 16): 0.030}
    library, weight_major = lf.library, lf.weight_major

    def library_timed(x, weight, bias):
        clock.now += cost[lf.LIBRARY, weight.shape[0]] * x.reshape(-1, x.shape[-1]).shape[0] / 300
        return library(x, weight, bias)

    def weight_major_timed(x2, weight, contiguous=True):
        clock.now += cost[lf.SECOND, weight.shape[0]] * x2.shape[0] / 300
        return weight_major(x2, weight, contiguous)

    monkeypatch.setattr(lf, "library", library_timed)
    monkeypatch.setattr(lf, "weight_major", weight_major_timed)
    # the band's first pass runs whole in the library's form: 15 ms a call, past CALL_TIMED_S
    with chooser.pass_over(300) as form:
        torch.testing.assert_close(model(x), want, **TOL)
    assert form == lf.LIBRARY and 0.030 / 2 >= lf.CALL_TIMED_S
    # from then on each call times itself; each shape settles on its own cheaper form
    forms = []
    for _ in range(2 * lf.WARMUP + 2):
        before = clock.now
        with chooser.pass_over(300) as form:
            torch.testing.assert_close(model(x), want, **TOL)
        forms.append(form)
        spent = clock.now - before
    assert set(forms) == {lf.BY_CALL}
    band = lf.rows_key(300)
    assert chooser.chosen_by_call() == {(32, 16, band): "weight_major", (16, 32, band): "library"}
    assert spent == pytest.approx(0.010 + 0.010)    # both layers in their cheaper form
    assert chooser.chosen() == {}                   # the band's passes no longer choose whole
    # a call outside a pass takes its shape's choice
    torch.testing.assert_close(model(x), want, **TOL)
    assert clock.now - before - spent == pytest.approx(0.020)
    # a band of short calls is still chosen by whole passes
    small = torch.randn(4, 16)
    run = []
    for _ in range(2 * lf.WARMUP):
        with chooser.pass_over(4) as form:
            model(small)
        run.append(form)
    assert run == [lf.LIBRARY, lf.SECOND] * lf.WARMUP
    assert 4 in chooser.chosen()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def test_swap_keeps_parameters_names_and_ties():
    torch.manual_seed(0)
    model = Tied().eval()
    names = list(model.state_dict())
    ids = torch.randint(0, 50, (7,))
    want = model(ids)
    chooser = lf.measure_linear_forms(model)
    assert chooser is not None
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert sum(type(m) is lf.MeasuredLinear for m in model.modules()) == 3
    assert list(model.state_dict()) == names
    assert model.head.weight is model.embed.weight
    for _ in range(2 * lf.WARMUP + 1):
        with chooser.pass_over(7):
            torch.testing.assert_close(model(ids), want, **TOL)
    torch.testing.assert_close(model(ids), want, **TOL)      # outside a pass: the settled form


@pytest.fixture
def llama_dir(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from hf_helpers import save_model_dir, tiny_llama

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return save_model_dir(tiny_llama(), tmp_path / "m")


def test_hf_backend_scores_alike_in_either_form(llama_dir):
    from sdcp_fast.models import load_backend

    measured = load_backend(f"hf:{llama_dir}")
    library = load_backend(f"hf:{llama_dir}?linear=library")
    assert measured.linear_forms is not None and library.linear_forms is None
    assert any(type(m) is lf.MeasuredLinear for m in measured.model.modules())
    assert not any(type(m) is lf.MeasuredLinear for m in library.model.modules())
    assert measured.digest == library.digest
    sessions = [bytes([n]) * 16 for n in range(3)]
    for be in (measured, library):
        for n, sid in enumerate(sessions):
            be.open(sid, [3 + n, 4, 5, 6])
    for step in range(2 * lf.WARMUP + 2):     # through the warm-up of the row count and past it
        items = [(sid, [7 + (step + n) % 20] * (1 + n % 2)) for n, sid in enumerate(sessions)]
        torch.testing.assert_close(measured.score(items), library.score(items), **TOL)
        for sid, x in items:
            measured.commit(sid, x)
            library.commit(sid, x)
    assert measured.linear_forms.chosen()     # the passes' row count has chosen


def test_elementwise_fed_layers_return_the_same_values_transposed():
    torch.manual_seed(5)
    layer = nn.Linear(64, 40, bias=True)
    chooser = lf.FormChooser(streamed=False)
    plain, fed = lf.MeasuredLinear(layer, chooser), lf.MeasuredLinear(layer, chooser, any_layout=True)
    x = torch.randn(2, lf.STREAMED_ROWS + 3, 64)
    chooser.current = lf.SECOND
    want, got = plain(x), fed(x)
    chooser.current = lf.LIBRARY
    library = fed(x)
    chooser.current = None
    assert want.is_contiguous() and not got.is_contiguous()   # the product as the BLAS left it
    assert got.shape == want.shape == (2, lf.STREAMED_ROWS + 3, 40)
    assert torch.equal(got, want)
    assert library.is_contiguous()                              # the library's form is untouched
    torch.testing.assert_close(library, want, **TOL)


@pytest.mark.parametrize("rows", [lf.STREAMED_ROWS + 1, 24])
def test_a_wide_weight_major_product_is_copied_into_row_order_block_by_block(monkeypatch, rows):
    """A product wider than the cache's block (the vocabulary's projection) is computed in
    blocks of output features, the last one partial: the same values, in row order, for
    every row count; one whose block would be thinner than MIN_BLOCK_FEATURES is whole."""
    torch.manual_seed(6)
    monkeypatch.setattr(lf, "TRANSPOSE_BLOCK_BYTES", lf.MIN_BLOCK_FEATURES * 4 * rows)
    weight, x2 = torch.randn(1000, 64), torch.randn(rows, 64)   # blocks of 256 features: 3 and a part
    blocks = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: blocks.append(a.shape[0]) or real_mm(a, b, **kw))
    got = lf.weight_major(x2, weight)
    assert blocks == [256, 256, 256, 232]
    assert got.is_contiguous() and got.shape == (rows, 1000)
    torch.testing.assert_close(got, real_mm(x2, weight.t()), **TOL)
    blocks.clear()
    monkeypatch.setattr(lf, "TRANSPOSE_BLOCK_BYTES", (lf.MIN_BLOCK_FEATURES - 64) * 4 * rows)
    whole = lf.weight_major(x2, weight)
    assert blocks == [1000] and whole.is_contiguous()
    torch.testing.assert_close(whole, got, **TOL)


def test_a_llama_hands_transposed_products_only_to_elementwise_operations(llama_dir):
    """Which layers of transformers' Llama decoder may return the weight-major product
    transposed: the MLP's three and the attention's output projection, never q, k, v (their
    outputs are reshaped into heads) nor the vocabulary's projection (the logits). With them
    transposed, the model's logits are bit for bit those with every product in row order."""
    from sdcp_fast.models import load_backend

    backend = load_backend(f"hf:{llama_dir}")
    model = backend.model
    measured = {name: m for name, m in model.named_modules() if type(m) is lf.MeasuredLinear}
    fed = {name for name, m in measured.items() if m.any_layout}
    assert fed == {name for name in measured
                   if name.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj"))}
    assert len(fed) == 4 * model.config.num_hidden_layers
    assert lf.elementwise_fed(nn.Linear(2, 2)) == ()            # an architecture not listed: none
    ids = torch.randint(3, 40, (3, lf.STREAMED_ROWS + 5))        # 63 rows: the weight-major form
    chooser = backend.linear_forms
    chooser.current = lf.SECOND
    try:
        with torch.no_grad():
            transposed = model(input_ids=ids).logits
            for name in fed:
                measured[name].any_layout = False
            row_order = model(input_ids=ids).logits
    finally:
        chooser.current = None
    assert torch.equal(transposed, row_order)
