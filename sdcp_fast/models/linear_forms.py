"""Linear layers on the CPU computed in whichever of two forms runs faster, chosen by timing
whole passes of the model in each.

y = x W^T (+ b), x [T, in], W [out, in], is computed in one of two forms over the same weight
storage:

  * `library`: `x @ W.T`, what `torch.nn.functional.linear` asks (for one row, a
    matrix-vector product);
  * the second form:
    - `streamed` for passes of at most STREAMED_ROWS rows where the native op is built
      (`kernels.native.rows_linear`, csrc/): each weight row read from memory once for up
      to 8 rows, as one sequential stream per thread;
    - else `weight_major`: `(W @ x.T).T` asked of the BLAS, made contiguous (left transposed
      for a layer whose output feeds only elementwise operations: `ELEMENTWISE_FED`); one row is
      duplicated so that the BLAS runs its matrix-matrix path, and the copy's result is dropped.
      Above STREAMED_ROWS rows this order can cost less than the library's for a wide layer
      (the vocabulary's projection), or more, depending on the BLAS and the CPU.

All are the same product. The BLAS picks its kernel, its packing and its threading from the
shapes it is given: for one row a matrix-vector product that streams the weight, for a few
rows (a verify pass of M + 1 tokens, a decode step of a few sessions) a matrix-matrix path
that can cost far more, or not, depending on the BLAS build, the CPU and the row count. So
nothing here is a constant. The unit measured is the whole pass (`FormChooser.pass_over`),
not one layer's call: a form's cost shows partly in the calls after it (the OpenMP team it
leaves awake or asleep, the caches it leaves warm), so a layer timed alone can look cheaper
in the form that makes the pass dearer. Each row count runs its passes in the two forms
alternately, the library's first (a row count seen once, as most prefills' are, runs as the
library would run it), until each has `WARMUP` timings, then in the one with the lower
median of its last `SAMPLES`, and once every `RECHECK` passes in the other, so that a change
of load or of the machine's behaviour is followed; a change of form is confirmed by both
forms alternating afresh (`TwoWayChooser`'s `confirm`: passes slowed by other work on the
machine must not hold a row count in the dearer form). Row counts share a key in bands
(`rows_key`), which keeps the table small and the warm-up short whatever the prefills' sizes.

Passes whose linear calls are long (a prefill of hundreds of tokens: its first pass in a
band averaging at least `CALL_TIMED_S` a call) choose per call instead: each call is timed
on its own and each layer shape (with the call's rows band) keeps its own choice, the
forms alternating call by call until each has its warm-up. A call that long is its own
measure (what it leaves behind for the next one is a vanishing share of it), and passes
that long are too few and too dear to alternate whole: a band of prefills sees a handful
of them, and half of its warm-up would run every layer in the dearer form, while the
calls of one prefill settle every shape within it.

The forms agree to fp32 rounding, not bit for bit at every shape: each sums in its own
order. A caller that needs transformers' own bits (a reference run, a baseline) keeps
`nn.Linear` (the `hf:` backend's `linear=library`). A call outside any pass (a model's own
`generate`) uses the form its row count has settled on, else the library's.
Only CPU models are measured (synchronous ops: the wall clock around a pass is its cost);
`measure_linear_forms` leaves a model on another device untouched.

Swapping uses `nn.Module.set_submodule`, so the model's classes and methods stay as the
library ships them; each `MeasuredLinear` holds the replaced layer's own parameters (tied
weights stay tied, state-dict names are unchanged).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..core.choice import TwoWayChooser
from ..core.control import size_band
from ..kernels import native

LIBRARY, SECOND = 0, 1
STREAMED_ROWS = 16   # the second form is `streamed` up to this many rows (weight_major above)
WARMUP = 3           # timed passes of each form before a row count chooses
SAMPLES = 7          # recent passes of each form a row count keeps
RECHECK = 200        # every RECHECK-th pass of a row count runs in the form not chosen
EXACT_ROWS = STREAMED_ROWS + 1   # row counts up to this are keys of their own (no band holds both
                                 # second forms); above, bands an eighth wide
CALL_TIMED_S = 5e-3  # a band whose first pass averages this long a linear call chooses per call:
                     # a hundred times an OpenMP team's wake-up, what a call can leave to the next
BY_CALL = 2          # `FormChooser.current` in such a pass: each call takes its own shape's choice


def _transpose_block_bytes() -> int:
    """Half the per-core L2 cache (the system's figure; 512 KiB when it gives none): the
    block of a weight-major product copied into row order while it is still cached."""
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        l2 = 0
    return (l2 if l2 > 0 else 512 << 10) // 2


TRANSPOSE_BLOCK_BYTES = _transpose_block_bytes()
MIN_BLOCK_FEATURES = 256   # fewer output features a block than this: the products too thin to pay

# Per architecture (transformers' `config.model_type`), the linear layers whose output the
# library's decoder passes only to elementwise operations: the MLP's activation and product
# (gate, up), the residual sums (down, the attention's output projection). Those take any
# memory layout at the cost of a contiguous one, so the weight-major form hands them its
# product transposed instead of copying it into row order. The same values either way: only
# where they lie in memory differs.
# Listed from the decoder's code, architecture by architecture; any other model's layers
# all return row order.
ELEMENTWISE_FED: dict[str, tuple[str, ...]] = {
    "llama": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj"),
}


def rows_key(rows: int) -> int:
    """The row count a key stands for: exact up to EXACT_ROWS, then bands an eighth wide."""
    return size_band(rows, EXACT_ROWS)


def streamed_available() -> bool:
    """Whether the native op's `rows_linear` is built (else the second form is weight_major)."""
    return native.unavailable_reason() is None


def _choice() -> TwoWayChooser:
    return TwoWayChooser(LIBRARY, warmup=WARMUP, samples=SAMPLES, recheck=RECHECK, confirm=True)


class FormChooser:
    """The measured choice of form per row count, shared by the linear layers of one model.
    Not thread-safe: a backend's passes run on one thread (its compute thread)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *,
                 streamed: bool | None = None) -> None:
        self.clock = clock
        self.streamed = streamed_available() if streamed is None else streamed
        self.forms = ("library", "streamed" if self.streamed else "weight_major")   # at <= STREAMED_ROWS
        self.current: int | None = None          # the form of the pass under way (or BY_CALL)
        self.calls = 0                           # linear calls of the pass under way
        self._keys: dict[int, TwoWayChooser] = {}
        self._by_call: set[int] = set()          # bands whose passes choose per call
        self._calls: dict[tuple[int, int, int], TwoWayChooser] = {}   # (out, in, rows band) -> choice

    @contextmanager
    def pass_over(self, rows: int) -> Iterator[int]:
        """Run one pass of the model over `rows` new tokens in the form chosen for it (yielded),
        timed; a pass that raises is not counted. In a band that chooses per call, BY_CALL is
        yielded and each call times itself (`call_choice`)."""
        key = rows_key(rows)
        if key in self._by_call:
            self.current = BY_CALL
            try:
                yield BY_CALL
            finally:
                self.current = None
            return
        choice = self._keys.get(key)
        if choice is None:
            choice = self._keys[key] = _choice()
        form = self.current = choice.way
        self.calls = 0
        started = self.clock()
        try:
            yield form
        finally:
            self.current = None
        elapsed = self.clock() - started
        choice.observe(form, elapsed)
        if self.calls and elapsed / self.calls >= CALL_TIMED_S:
            self._by_call.add(key)

    def call_choice(self, out_features: int, in_features: int, rows: int) -> TwoWayChooser | None:
        """The choice a call of this shape takes in a pass that chooses per call, else None
        (the call takes the pass's form)."""
        if self.current != BY_CALL:
            return None
        key = (out_features, in_features, rows_key(rows))
        choice = self._calls.get(key)
        if choice is None:
            choice = self._calls[key] = _choice()
        return choice

    def settled(self, rows: int, out_features: int | None = None, in_features: int | None = None) -> int:
        """The form for a call outside any pass: the row count's choice (its shape's, in a
        band that chooses per call), else (no choice yet) the library's."""
        if rows_key(rows) in self._by_call:
            choice = self._calls.get((out_features, in_features, rows_key(rows)))
        else:
            choice = self._keys.get(rows_key(rows))
        return LIBRARY if choice is None or choice.chosen is None else choice.chosen

    def chosen(self) -> dict[int, str]:
        """{row-count key: form name} for the keys whose passes have chosen (logs, tests)."""
        return {key: self.form_name(c.chosen, key) for key, c in self._keys.items()
                if c.chosen is not None and key not in self._by_call}

    def chosen_by_call(self) -> dict[tuple[int, int, int], str]:
        """{(out, in, rows key): form name} for the call shapes that have chosen (logs, tests)."""
        return {key: self.form_name(c.chosen, key[2]) for key, c in self._calls.items() if c.chosen is not None}

    def form_name(self, form: int, rows: int) -> str:
        """The name of `form` for passes of `rows` rows."""
        return "weight_major" if form == SECOND and rows > STREAMED_ROWS else self.forms[form]


def library(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The library's form: `x @ W.T` (+ b), as `nn.Linear` computes it."""
    return nn.functional.linear(x, weight, bias)


def weight_major(x2: torch.Tensor, weight: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """x2 [T, in] -> [T, out] as (W @ x2.T).T; a single row is computed as two. With
    `contiguous` off, the result is the transposed view of the product (no copy): for a
    consumer that takes any memory layout (`ELEMENTWISE_FED`). In row order, a product larger
    than `TRANSPOSE_BLOCK_BYTES` (the vocabulary's projection) is computed a block of output
    features at a time, each block copied into row order while the cache still holds it:
    the whole product transposed at once is read back from memory, at the cost of a sixth of
    the product itself."""
    rows = x2.shape[0]
    if rows == 1:
        return torch.mm(weight, torch.cat((x2, x2)).t())[:, :1].t().contiguous()
    if not contiguous:
        return torch.mm(weight, x2.t()).t()
    out_features = weight.shape[0]
    block = TRANSPOSE_BLOCK_BYTES // (rows * x2.element_size()) // 64 * 64
    if not MIN_BLOCK_FEATURES <= block < out_features:   # small enough as it is, or too many rows
        return torch.mm(weight, x2.t()).t().contiguous()
    y = torch.empty(rows, out_features, dtype=x2.dtype)
    part = torch.empty(block, rows, dtype=x2.dtype)
    x2t = x2.t()
    for start in range(0, out_features, block):
        stop = min(start + block, out_features)
        product = torch.mm(weight[start:stop], x2t, out=part[:stop - start])
        y[:, start:stop].copy_(product.t())
    return y


class MeasuredLinear(nn.Module):
    """`nn.Linear`'s computation with its form chosen by a `FormChooser`. Holds the layer's
    own `weight` [out, in] and `bias` [out] or None (the same Parameter objects).
    `any_layout`: the layer's output feeds only elementwise operations, so the weight-major
    form may return it transposed, without the copy (`ELEMENTWISE_FED`)."""

    def __init__(self, linear: nn.Linear, chooser: FormChooser, *, any_layout: bool = False) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chooser = chooser
        self.any_layout = any_layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        chooser = self.chooser
        chooser.calls += 1
        choice = chooser.call_choice(self.out_features, self.in_features, x2.shape[0])
        if choice is not None:   # timed on its own
            form = choice.way
            started = chooser.clock()
            y = self._product(x, x2, form)
            choice.observe(form, chooser.clock() - started)
            return y
        form = chooser.current
        if form is None:
            form = chooser.settled(x2.shape[0], self.out_features, self.in_features)
        return self._product(x, x2, form)

    def _product(self, x: torch.Tensor, x2: torch.Tensor, form: int) -> torch.Tensor:
        if form == LIBRARY:
            return library(x, self.weight, self.bias)
        if self.chooser.streamed and x2.shape[0] <= STREAMED_ROWS and native.rows_linear_fits(x2, self.weight):
            y = native.rows_linear(x2, self.weight)
        else:
            y = weight_major(x2, self.weight, contiguous=not self.any_layout)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def elementwise_fed(model: nn.Module) -> tuple[str, ...]:
    """Name endings of the linear layers whose output `model` passes only to elementwise
    operations (`ELEMENTWISE_FED` of its architecture; none for an architecture not listed)."""
    config = getattr(model, "config", None)
    return ELEMENTWISE_FED.get(getattr(config, "model_type", None), ())


def measure_linear_forms(model: nn.Module, chooser: FormChooser | None = None) -> FormChooser | None:
    """Replace every `nn.Linear` of a CPU model with a `MeasuredLinear` sharing one chooser;
    the chooser, or None for a model on another device (left as it is)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    chooser = chooser or FormChooser()
    fed = elementwise_fed(model)
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        model.set_submodule(name, MeasuredLinear(model.get_submodule(name), chooser,
                                                 any_layout=bool(fed) and name.endswith(fed)))
    return chooser
