"""Shared fixtures: a small random built-in model saved to a file."""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_model

from sdcp_fast.models.weights import save_tiny


@pytest.fixture
def tiny_path(tmp_path):
    path = tmp_path / "small.safetensors"
    # fp32 storage: the in-memory reference model and the loaded backend agree exactly
    save_tiny(random_model(), path, dtype=torch.float32)
    return path
