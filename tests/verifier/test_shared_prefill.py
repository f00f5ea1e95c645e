"""n sessions opened with one prompt (session-open's `prefill_share`) share one prefill at the
verifier: the first one's K/V is exported and the others import it; what is kept for them
is bounded by count, bytes and age, and goes once as many sessions as announced took it."""

from __future__ import annotations

import asyncio

import torch

from sdcp_fast.models import load_backend
from sdcp_fast.verifier import target as target_module
from sdcp_fast.verifier.target import SharedPrefills, TargetModel

PROMPT = [5, 7, 9, 11, 13]


def test_sessions_announced_together_prefill_once():
    async def main():
        model = TargetModel(load_backend("tiny:demo-target"))
        for n in range(3):
            await model.prefill(bytes([n]) * 16, PROMPT, None, reopen=False, share=3)
        assert model.prefills == 1
        for n in range(3):   # each holds the prompt, and scores as a prefilled session does
            assert model.backend.committed(bytes([n]) * 16) == PROMPT
        rows = model.backend.score([(bytes([n]) * 16, [3]) for n in range(3)])
        # (to float rounding: an imported session recomputes the prompt's last position)
        assert all(torch.allclose(rows[0:2], rows[2 * n:2 * n + 2], atol=1e-4) for n in range(3))
        await model.prefill(b"\x09" * 16, PROMPT, None, reopen=False, share=3)
        assert model.prefills == 2            # all three announced took theirs: a new group prefills
        await model.prefill(b"\x0a" * 16, PROMPT, None, reopen=False)
        assert model.prefills == 3            # one that announced nothing never looks

    asyncio.run(main())


def test_what_is_kept_is_bounded(monkeypatch):
    shared = SharedPrefills()
    for n in range(target_module.SHARED_MAX + 3):
        shared.offer([n], b"x" * 10, 1)
    assert shared.take([0]) is None and shared.take([target_module.SHARED_MAX + 2]) == b"x" * 10
    shared.offer([99], b"y" * (target_module.SHARED_MAX_BYTES + 1), 1)
    assert shared.take([99]) is None      # larger than the whole budget: not kept
    monkeypatch.setattr(target_module, "SHARED_KEEP_S", -1.0)
    shared.offer([100], b"z", 2)
    assert shared.take([100]) is None     # expired
