"""The built-in backend on another device and dtype: weights, K/V and logits stay there."""

from __future__ import annotations

import pytest
import torch
from model_helpers import SMALL, random_model

from sdcp_fast.models.base import token_list_bytes
from sdcp_fast.models.gpt import ModelConfig
from sdcp_fast.models.tiny import TinyBackend

CFG = ModelConfig(**{**SMALL.__dict__, "vocab_size": 300})
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pair(device: str, dtype):
    reference = TinyBackend(random_model(CFG), bytes(32))
    other = TinyBackend(random_model(CFG), bytes(32), device=device, dtype=dtype)
    for b in (reference, other):
        b.open(b"s", [1, 2, 3, 4, 5])
    return reference, other


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_stay_on_the_device_in_the_model_dtype(device, dtype):
    reference, other = pair(device, dtype)
    want = reference.score([(b"s", [7, 8, 9])])
    got = other.score([(b"s", [7, 8, 9])])
    assert got.device.type == device and got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 0.1   # bf16 weights and activations
    assert (got.float().cpu() - want).abs().max() <= tolerance * max(1.0, float(want.abs().max()))
    assert other.model.rope.dtype == torch.float32          # positions exact in any dtype
    assert (other.digest == reference.digest) == (dtype == torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_export_and_import_across_devices(device):
    reference, other = pair(device, torch.bfloat16)
    other.commit(b"s", [7, 8])
    blob = other.export_kv(b"s")           # host bytes, whatever the device
    again = TinyBackend(random_model(CFG), bytes(32), device=device, dtype=torch.bfloat16)
    again.import_kv(b"s", blob)
    assert again.cached_tokens(b"s") == other.cached_tokens(b"s")
    assert torch.equal(again.score([(b"s", [9])]), other.score([(b"s", [9])]))
    assert again.kv_bytes() == other.kv_bytes() and again.kv_bytes() % 2 == 0


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError):
        TinyBackend(random_model(CFG), bytes(32), dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_session_memory_follows_the_model_dtype(device):
    """The memory budgets (issue 22) count K/V and logits rows at the model's item size."""
    reference, other = pair(device, torch.bfloat16)
    for b in (reference, other):
        b.score([(b"s", [7, 8, 9])])
    lists = reference.session_bytes(b"s") - reference.kv_bytes() - reference._get(b"s").rows.numel() * 4
    assert other.session_bytes(b"s") - lists == (reference.session_bytes(b"s") - lists) // 2
    for n in (0, 100):
        lists = 2 * token_list_bytes(n)
        assert other.bytes_for(n) - lists == (reference.bytes_for(n) - lists) // 2
