"""The launches the compile check covers: every Triton launch of `triton_path` for the GPUs
the kernels are written for, at the batch shapes the verifier sends, recorded through the
compile-only target (compile_target.py) and kept once per specialisation key.

What is swept, per GPU model (`GPU_MODELS`: its architecture and multiprocessor count, which
sizes the V-split):
- logits fp32, bf16 and fp16 (`batch.LOGIT_DTYPES`); V in `VOCABS`;
- `verify` on every B in 1..`MAX_PROPOSALS` with every M in 1..`MAX_DRAFT` drafted tokens per
  proposal, every proposal rule 2 (q rows for all), built as the verifier builds it (`pack_batch`'s two buffers, unpacked into views: the views' offsets
  decide which pointers Triton sees as 16-byte aligned);
- then, for each LaunchConfig that `launch_config_for` returns for some row count up to
  `MAX_PROPOSALS * (MAX_DRAFT + 1)` and that the uniform batches did not produce, one ragged
  batch with that many rows; `target_probs` once per LaunchConfig; one batch without q.

`SWEEPS` names the B x M grids: "full" (the above), "ci" (every B, M in 1, 2, 3 and 16:
every parity of B and of N = B x M; a quarter of the calls, for the test suite) and "quick"
(a sample, a twentieth of the calls, for bench/gpu_check.sh); all three give the same
specialisations today, and the full one is bench/gpu_compile.py's default.
`jit_functions` and `never_compiled` find the jit functions that no compiled kernel is or
calls: a kernel that no launch reaches fails the check.

Nothing here names a kernel or a signature: a new kernel or a changed launch in triton_path
is recorded as it is launched.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import JITFunction

from . import triton_path
from .batch import LOGIT_DTYPES, PackedBatch, VerifyBatch
from .compile_target import RecordedLaunch, recording_launches

META = torch.device("meta")
VOCABS = (32_000, 49_152, 128_256, 151_936)
MAX_PROPOSALS = 128
MAX_DRAFT = 16
ALL_PROPOSAL_COUNTS = range(1, MAX_PROPOSALS + 1)
ALL_DRAFT_COUNTS = range(1, MAX_DRAFT + 1)
SWEEPS = {
    "full": (ALL_PROPOSAL_COUNTS, ALL_DRAFT_COUNTS),
    "ci": (ALL_PROPOSAL_COUNTS, (1, 2, 3, MAX_DRAFT)),
    "quick": ((1, 2, 3, 8, 63, 64, 127, 128), (1, 2, 3, MAX_DRAFT)),
}


@dataclass(frozen=True)
class GpuModel:
    name: str
    target: GPUTarget
    sm_count: int


GPU_MODELS = (
    GpuModel("H100/H200 SXM", GPUTarget("cuda", 90, 32), 132),
    GpuModel("B200", GPUTarget("cuda", 100, 32), 148),
)


def meta_batch(drafts_per_proposal: list[int], vocab: int, dtype: torch.dtype, with_q: bool = True) -> VerifyBatch:
    """A batch of meta tensors laid out as `pack_batch` lays it out on a device: with q rows
    for every draft (rule 2) or none (rule 1 only)."""
    b, n = len(drafts_per_proposal), sum(drafts_per_proposal)
    rows = n + b
    packed = PackedBatch(
        logits=torch.empty(rows, vocab, dtype=dtype, device=META),
        ints=torch.empty(8 * b + n, dtype=torch.int64, device=META),
        floats=torch.empty(n + rows, dtype=torch.float64, device=META),
        q=torch.empty(n, vocab, dtype=torch.float32, device=META) if with_q else None, num_proposals=b)
    return packed.unpack()


def ragged_drafts(rows: int) -> list[int]:
    """Drafts per proposal (each 1..MAX_DRAFT) of a batch with `rows` logits rows and as few
    proposals as that allows."""
    b = -(-rows // (MAX_DRAFT + 1))
    drafts = rows - b
    return [drafts // b + (i < drafts % b) for i in range(b)]


def uniform_batches(proposal_counts: Iterable[int], draft_counts: Iterable[int]) -> Iterator[list[int]]:
    draft_counts = tuple(draft_counts)
    for b in proposal_counts:
        for m in draft_counts:
            yield [m] * b


def config_representatives(vocab: int, sm_count: int, max_rows: int) -> dict[triton_path.LaunchConfig, int]:
    """The smallest row count (from 1) for each LaunchConfig of rows up to `max_rows`."""
    first: dict[triton_path.LaunchConfig, int] = {}
    for rows in range(1, max_rows + 1):
        first.setdefault(triton_path.launch_config_for(rows, vocab, sm_count), rows)
    return first


def _verify(drafts: list[int], vocab: int, dtype: torch.dtype, sm_count: int,
            with_q: bool = True) -> triton_path.LaunchConfig:
    batch = meta_batch(drafts, vocab, dtype, with_q)
    cfg = triton_path.launch_config_for(batch.logits.shape[0], vocab, sm_count)
    triton_path.verify(batch, cfg)
    return cfg


def _target_probs(rows: int, vocab: int, dtype: torch.dtype, cfg: triton_path.LaunchConfig) -> None:
    profile = torch.empty(rows, dtype=torch.int64, device=META)
    triton_path.target_probs(torch.empty(rows, vocab, dtype=dtype, device=META), profile, profile,
                             profile, cfg)


def record_gpu(gpu: GpuModel, proposal_counts: Iterable[int] = ALL_PROPOSAL_COUNTS,
               draft_counts: Iterable[int] = ALL_DRAFT_COUNTS, dtypes: Iterable[torch.dtype] = LOGIT_DTYPES,
               vocabs: Iterable[int] = VOCABS,
               extra_launches: Callable[[], None] | None = None) -> tuple[list[RecordedLaunch], int]:
    """(one RecordedLaunch per distinct specialisation, number of launcher calls) for the
    sweep on `gpu` (pass no vocabs for none of it), then `extra_launches()` (a caller's own
    launchers, run on meta tensors)."""
    max_rows = MAX_PROPOSALS * (MAX_DRAFT + 1)
    proposal_counts, draft_counts, dtypes = tuple(proposal_counts), tuple(draft_counts), tuple(dtypes)
    calls = 0
    with recording_launches(gpu.target) as recorded:
        for vocab in vocabs:
            representatives = config_representatives(vocab, gpu.sm_count, max_rows)
            for dtype in dtypes:
                seen: set[triton_path.LaunchConfig] = set()
                for drafts in uniform_batches(proposal_counts, draft_counts):
                    seen.add(_verify(drafts, vocab, dtype, gpu.sm_count))
                    calls += 1
                for cfg, rows in representatives.items():
                    if cfg not in seen and rows >= 2:
                        _verify(ragged_drafts(rows), vocab, dtype, gpu.sm_count)
                        calls += 1
                    _target_probs(rows, vocab, dtype, cfg)
                    calls += 1
                _verify([1], vocab, dtype, gpu.sm_count, with_q=False)   # no rule-2 proposal: no q
                calls += 1
        if extra_launches is not None:
            extra_launches()
            calls += 1
    return list(recorded.values()), calls


def jit_functions(modules: Iterable[ModuleType]) -> dict[str, JITFunction]:
    """Every @triton.jit function defined in `modules`, by name."""
    found = {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[name] = value
    return found


def _called_names(function: JITFunction) -> set[str]:
    tree = ast.parse(textwrap.dedent(function.src))
    return {node.func.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def never_compiled(functions: dict[str, JITFunction], compiled: Iterable[str]) -> list[str]:
    """The functions of `functions` that no compiled kernel is or calls (directly or through
    another function), sorted: a kernel no launch reaches, or dead device code."""
    reached, todo = set(), [name for name in compiled if name in functions]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo.extend(callee for callee in _called_names(functions[name]) if callee in functions)
    return sorted(set(functions) - reached)
