"""Kernel tests: run the Triton kernels in the interpreter unless a GPU is there.

TRITON_INTERPRET must be set before triton is first imported (the Makefile exports it too).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from kernel_cases import interpreting, require_native  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=["cpu", "native", "native-scalar", "triton"])
def path(request, monkeypatch) -> str:
    """Implementation under test: 'cpu' is the vectorised torch path (also on CUDA tensors),
    'native' the C++ op (csrc/) with its best row loops, 'native-scalar' the same op on its
    portable loops (what a CPU without AVX2 runs)."""
    if request.param.startswith("native"):
        require_native()
        if request.param == "native-scalar":
            monkeypatch.setenv("SDCP_NATIVE_ISA", "scalar")
        return "native"
    return request.param


@pytest.fixture
def target(device, path) -> tuple[torch.device, str]:
    """(device, path) pairs that can run here: Triton on CPU tensors needs the interpreter;
    the native op runs on CPU tensors only."""
    if path == "native" and device.type != "cpu":
        pytest.skip("the native op runs on CPU tensors")
    if path == "triton" and device.type == "cpu" and not interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (this run uses the GPU)")
    if path == "triton" and device.type == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: CUDA launches are not interpreted here")
    return device, path
