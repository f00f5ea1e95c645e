"""kernels.batch.list_tensor makes what torch.tensor makes from a list of ints or floats."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sdcp_fast.kernels.batch import list_tensor

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(INT64, max_size=300))
def test_int64_lists_make_the_tensor_torch_tensor_makes(values):
    made, expected = list_tensor(values, torch.int64), torch.tensor(values, dtype=torch.int64)
    assert made.dtype == expected.dtype and made.shape == expected.shape and made.device == expected.device
    assert torch.equal(made, expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=300))
def test_float64_lists_make_the_tensor_torch_tensor_makes(values):
    made, expected = list_tensor(values, torch.float64), torch.tensor(values, dtype=torch.float64)
    assert made.dtype == expected.dtype and made.shape == expected.shape
    assert torch.equal(made.isnan(), expected.isnan())
    assert torch.equal(made.nan_to_num(0.0), expected.nan_to_num(0.0))   # bit for bit, signed zeros aside
    assert [math.copysign(1, x) for x in made.tolist()] == [math.copysign(1, x) for x in expected.tolist()]


def test_the_tensor_outlives_the_list_and_owns_writable_memory():
    values = [5, 6, 7]
    made = list_tensor(values, torch.int64, "cpu")
    del values
    gc.collect()
    made += 1   # no warning, no error: the C array is the tensor's own
    assert made.tolist() == [6, 7, 8]
    assert made.is_contiguous()


def test_a_float_in_an_int64_list_is_refused_not_truncated():
    with pytest.raises(TypeError):
        list_tensor([1, 2.5], torch.int64)


def test_other_dtypes_are_refused():
    for values in ([1], []):
        with pytest.raises(KeyError):
            list_tensor(values, torch.int32)
