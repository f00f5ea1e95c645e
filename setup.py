"""What pyproject.toml cannot say: the package list under the kernels/ -> sdcp_fast.kernels
mapping, the native CPU op (csrc/) built with torch's extension tools, and the strict CBOR
decoder's fast path (csrc/cbor/, a plain CPython extension: core never needs torch).

The op compiles against the torch of the environment that installs the package, so build
without pip's build isolation (which would fetch another torch, a CUDA build of several GB on
these machines) - the Makefile does:

    pip install --no-build-isolation -e '.[dev]'

The op is optional. Without torch at build time (an isolated build) or without a working C++
compiler the package installs without it, this script says so, and sdcp_fast.kernels uses
kernels/cpu.py (kernels/native.py says so once at run time). The library is loaded with
torch.ops.load_library, not imported: it has no Python bindings, only TORCH_LIBRARY ops.
The CBOR fast path is optional too: without it core/cbor.py decodes everything in Python.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

packages = ["sdcp_fast", *(f"sdcp_fast.{p}" for p in find_packages("sdcp_fast"))]
packages += ["sdcp_fast.kernels", *(f"sdcp_fast.kernels.{p}" for p in find_packages("kernels"))]

NATIVE = "sdcp_fast.kernels._native"
CSRC = Path("csrc")
SOURCES = ["sdcp_ops.cpp", "cpu/isa.cpp", "cpu/verify_cpu.cpp", "cpu/rows.cpp",
           "cpu/vector_loops_scalar.cpp", "cpu/vector_loops_avx2.cpp", "cpu/vector_loops_avx512.cpp",
           # the twin decoder (twin: backend)
           "cpu/twin_cpu.cpp", "cpu/twin_loops_scalar.cpp", "cpu/twin_loops_avx2.cpp",
           "cpu/twin_loops_avx512.cpp"]


def say(message: str) -> None:
    print(f"sdcp-fast setup: {message}", file=sys.stderr)


CBOR_C = "sdcp_fast.core._cbor_c"
# the fast path of core/cbor.py's decoder; optional: a failed compile leaves the Python reader
CBOR_EXT = Extension(CBOR_C, sources=[str(CSRC / "cbor" / "cbor_decode.c")],
                     extra_compile_args=["-O2", "-Wall"], optional=True)


def native_build() -> dict:
    """ext_modules and cmdclass for the native op and the CBOR fast path, or the CBOR fast
    path alone when torch is not importable."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        say(f"torch is not importable here (isolated build?): {NATIVE} is not built; "
            "kernels/cpu.py serves. Build with `pip install --no-build-isolation`.")
        return {"ext_modules": [CBOR_EXT]}

    class OptionalBuildExtension(BuildExtension):
        """A failed compile leaves the package without the op instead of failing the install."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 (compiler missing or broken: any error)
                say(f"{NATIVE} not built ({type(exc).__name__}: {exc}); kernels/cpu.py serves.")

    # csrc/cpu/parallel.h splits work over OpenMP threads only where the source is compiled
    # with OpenMP (without it every split runs serially in the calling thread). Linked the
    # same way, the op's libgomp.so.1 is the one torch loaded already: one OpenMP runtime,
    # one team per thread.
    import torch
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    # every source in the project's own namespace (sources with torch headers take ~20 s each)
    ext = CppExtension(
        NATIVE,
        sources=[str(CSRC / s) for s in SOURCES],
        include_dirs=[str((CSRC / "cpu").resolve())],
        # the headers and the loops the sources include: a change to one alone rebuilds
        # (setuptools compares the library's time with the sources' and these)
        depends=sorted(str(p) for p in CSRC.rglob("*") if p.suffix in (".h", ".inc")),
        extra_compile_args=["-O3", "-Wall", "-Wno-unused-parameter", *openmp],
        extra_link_args=openmp,
    )
    # ninja is not a dependency: setuptools compiles the sources one by one
    return {"ext_modules": [ext, CBOR_EXT],
            "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=False)}}


setup(packages=packages, **native_build())
