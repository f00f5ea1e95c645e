"""Kernel tests: run the Triton kernels in the interpreter unless a GPU is there.

TRITON_INTERPRET must be set before triton is first imported (the Makefile exports it too).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from kernel_cases import interpreting  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=["cpu", "triton"])
def path(request) -> str:
    """Implementation under test; 'cpu' is the vectorised torch path (also on CUDA tensors)."""
    return request.param


@pytest.fixture
def target(device, path) -> tuple[torch.device, str]:
    """(device, path) pairs that can run here: Triton on CPU tensors needs the interpreter."""
    if path == "triton" and device.type == "cpu" and not interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (this run uses the GPU)")
    if path == "triton" and device.type == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: CUDA launches are not interpreted here")
    return device, path
