"""transformers imports whole from a checkout, where the repo root is on sys.path.

This project's verify kernels live in a top-level `kernels/` (installed as
`sdcp_fast.kernels`). transformers 5.25 requires Hugging Face's distribution of the same
import name and, once it is installed, imports `from kernels import CUDAProperties` while
loading a model: from a checkout our directory is found first and every model load fails
(pyproject pins transformers below 5.25 for this). A version that needs it again fails here
first, not in the model tests."""

import importlib
import importlib.util

import pytest

pytest.importorskip("transformers")


def test_transformers_hub_kernels_integration_imports():
    importlib.import_module("transformers.integrations.hub_kernels")


def test_the_top_level_kernels_is_ours_or_absent_not_a_shadowed_hub_package():
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None:
        return
    from transformers.utils.import_utils import is_kernels_available
    if is_kernels_available():   # transformers would import Hugging Face's names from it
        module = importlib.import_module("kernels")
        assert hasattr(module, "CUDAProperties"), f"{spec.origin} shadows Hugging Face's kernels"
