"""Verify kernels (installed as sdcp_fast.kernels): float64 reference, CPU path, Triton kernels.

Public API:
- `verify(batch, path=None) -> VerifyResult` over a ragged batch (see `batch.py` for layout).
- `target_probs(logits, temperature_milli=None, top_k=None, top_p_milli=None, path=None)`.
- `build_batch(logits, proposals, q=None)` from `ProposalInput` values; `pack_batch` the same
  as a PackedBatch (two buffers: the native op reads them as they are, `verify` unpacks them
  for the other paths; its result's `rows()` is the same).
- `sample(probs, uniforms)`, `greedy(logits)`, `bad_rows(logits)` (both at once:
  `greedy_checked`) for rows without a proposal (the drafter's tokens, the verifier's self-decoded ones; see `sample.py`).
Path choice: `path` argument, else env `SDCP_KERNELS_PATH` (reference | cpu | native | triton),
else Triton for CUDA tensors when triton imports; on CPU tensors the native op (csrc/, see
native.py) when it is built, the torch CPU path (cpu.py) otherwise.
"""

from .batch import (
    DEFAULT_TEMPERATURE_MILLI,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P_MILLI,
    PackedBatch,
    PackedResult,
    ProposalInput,
    VerifyBatch,
    VerifyInputError,
    VerifyResult,
    build_batch,
    pack_batch,
    sampling_profile,
)
from .dispatch import available_paths, choose_path, target_probs, verify
from .sample import bad_rows, greedy, greedy_checked, sample

__all__ = [
    "DEFAULT_TEMPERATURE_MILLI", "DEFAULT_TOP_K", "DEFAULT_TOP_P_MILLI", "PackedBatch", "PackedResult", "ProposalInput",
    "VerifyBatch", "VerifyInputError", "VerifyResult", "available_paths", "bad_rows", "build_batch",
    "choose_path", "greedy", "greedy_checked", "pack_batch", "sample", "sampling_profile", "target_probs", "verify",
]
