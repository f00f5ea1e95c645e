"""A compile-only target: run the Triton launchers where there is no GPU and record what each
launch would compile, instead of compiling and running it.

Two of Triton's own extension points do it, so the signature, the constexprs and the
specialisation (pointer and integer divisibility by 16, integers equal to 1) are Triton's
decisions for the real arguments of the real launch, not a list written by hand:

- `CompileOnlyDriver` stands in for the CUDA driver (`triton.runtime.driver.set_active`): it
  names the GPU to compile for and has no device, stream or launcher;
- `triton.knobs.runtime.jit_cache_hook` sees every launch that misses the kernel cache with
  the key, signature, constexprs, attributes and options Triton derived from its arguments;
  returning True tells Triton to neither compile nor launch.

The launchers run on "meta" tensors (shapes, dtypes and offsets, no memory; an offset view
has the data_ptr alignment a CUDA allocation would give it), so a 128 x 17-row batch of
151,936-wide logits costs nothing to record. The recorded launch compiles with
`triton.compile(ASTSource(...), target=GPUTarget(...))` (compiled_facts.py).

Triton must not be in interpreter mode when `kernels.triton_path` is imported (with
TRITON_INTERPRET=1 `triton.jit` makes interpreted functions, which never reach the hook): the
check runs in a process of its own (bench/gpu_compile.py). That process keeps the stand-in
driver: without a GPU there is no real driver to restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import JITFunction, driver

# the compile options the hook reports and triton.compile takes back
RECORDED_OPTIONS = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "launch_cooperative_grid")


class CompileOnlyDriver(DriverBase):
    """The active Triton driver while launches are recorded: it reports `target` as the
    current GPU and one device per architecture (Triton keeps its per-device caches, the
    backend among them, by this number: two targets must not share one)."""

    def __init__(self, target: GPUTarget):
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False  # never chosen by Triton itself

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return int(self.target.arch)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a compile-only target builds no launcher")

    def get_benchmarker(self):
        raise NotImplementedError("a compile-only target runs nothing")


@dataclass(frozen=True)
class RecordedLaunch:
    """What one launch would compile: `triton.compile(ASTSource(kernel, signature,
    constexprs, attrs), target=target, options=options)`. `key` is Triton's specialisation
    key (argument types, divisibility, constexprs and options): two launches with one key
    compile to one binary."""

    kernel: JITFunction
    target: GPUTarget
    key: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextmanager
def recording_launches(target: GPUTarget) -> Iterator[dict[tuple[str, str], RecordedLaunch]]:
    """Within the block, a Triton launch is recorded, not compiled and not run. Yields the
    record: one RecordedLaunch per (kernel name, specialisation key), the first seen.

    Raises RuntimeError if a launch is interpreted (TRITON_INTERPRET was set when the
    kernels were imported)."""
    recorded: dict[tuple[str, str], RecordedLaunch] = {}

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        jit_function = fn.jit_function
        recorded.setdefault((jit_function.fn.__name__, key), RecordedLaunch(
            kernel=jit_function, target=target, key=key, signature=dict(compile["signature"]),
            constexprs=dict(compile["constants"]), attrs=dict(compile["configs"][0]),
            options={name: compile[name] for name in RECORDED_OPTIONS}))
        return True  # neither compile nor launch

    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(CompileOnlyDriver(target))
    knobs.runtime.jit_cache_hook = record
    try:
        yield recorded
    finally:
        knobs.runtime.jit_cache_hook = previous_hook


def require_compiler_mode(kernel: object) -> JITFunction:
    """`kernel` as a JITFunction, or RuntimeError when Triton made it for its interpreter."""
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel!r} is not a JITFunction: import the kernels without TRITON_INTERPRET=1 "
                           "to compile them")
    return kernel
